"""GET /sandboxes/{id}/events and /lineage through a real aiohttp server on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
import sqlalchemy as sa
from aiohttp import web

from keepstate.api import events as events_api
from keepstate.api.control import error_response
from keepstate.db.engine import Database
from keepstate.errors import KeepStateError
from keepstate.session import EventLog, EventRef, Lineage


@web.middleware
async def render_errors(request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        return await handler(request)
    except KeepStateError as exc:  # as the server's dispatch middleware does
        return error_response(exc)


@pytest.fixture
async def server(database: Database) -> AsyncIterator[tuple[str, Database]]:
    log, lineage = EventLog(database), Lineage(database)
    for i in range(5):
        await log.append("isbx", "step", {"i": i})
    cp = await log.append("isbx", "checkpoint", {"checkpoint_id": "c1"})
    await lineage.record_session("isbx", "base")
    await lineage.record_checkpoint("c1", "isbx", None, "snapshot", EventRef(cp.seq, cp.hash))
    app = web.Application(middlewares=[render_errors])
    app[events_api.EVENTS], app[events_api.LINEAGE] = log, lineage
    app.add_routes(events_api.routes)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", database
    await runner.cleanup()


async def test_events_paging_and_verify(server: tuple[str, Database]) -> None:
    url, database = server
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/sandboxes/isbx/events", params={"after": "2", "limit": "2"}) as r:
            body = await r.json()
        assert r.status == 200 and body["sessionId"] == "isbx" and "verified" not in body
        assert [e["seq"] for e in body["events"]] == [3, 4]
        async with http.get(f"{url}/sandboxes/isbx/events?verify=true") as r:
            body = await r.json()
        assert body["verified"] == {"ok": True, "checked": 6, "first_bad_seq": None, "reason": None}
        assert len(body["events"]) == 6
        async with database.transaction() as conn:  # an edit behind the server's back
            await conn.execute(sa.text("UPDATE events SET ts=ts+1 WHERE session_id='isbx' AND seq=4"))
        async with http.get(f"{url}/sandboxes/isbx/events?verify=true") as r:
            assert (await r.json())["verified"]["first_bad_seq"] == 4


async def test_errors_are_json(server: tuple[str, Database]) -> None:
    url, _ = server
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/sandboxes/nobody/events") as r:
            assert r.status == 404 and (await r.json())["code"] == 404
        async with http.get(f"{url}/sandboxes/isbx/events?after=x") as r:
            assert r.status == 400 and "after" in (await r.json())["message"]
        async with http.get(f"{url}/sandboxes/nobody/lineage") as r:
            assert r.status == 404


async def test_lineage(server: tuple[str, Database]) -> None:
    url, _ = server
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/sandboxes/isbx/lineage") as r:
            tree = await r.json()
    assert r.status == 200 and tree["root"]["sessionId"] == "isbx"
    assert tree["root"]["checkpoints"][0]["checkpointId"] == "c1"
