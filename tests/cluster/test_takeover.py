"""A paused session outlives its node: when the node is gone (it left, or the reaper declared it dead), a connect
through another node of the same database and store takes the sandbox over (its epoch moves on, so the old owner's
writes are refused) and resumes it there with its files; while the owner is live, the other node refuses it and
names the owner (a request not relayed to it already is relayed). The session's history records the move and still
verifies."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from pathlib import Path

import pytest

from keepstate.db.errors import Fenced
from keepstate.db.repos import Nodes, Sandboxes
from keepstate.testing import FakeRuntime
from keepstate.testing.databases import postgres  # noqa: F401
from keepstate.testing.postgres import PostgresServer

from ..sandbox.conftest import Served, serving
from ..sandbox.test_races import read_file, write_file

LEASE = (1.0, 0.1, 0.4)  # TTL, renewal, fence margin: a node declared dead within seconds


async def paused_on(a: Served) -> tuple[str, str]:
    status, made = await a.call("POST", "/sandboxes", {"templateID": "base", "timeout": 300})
    assert status == 201, made
    sid, token = made["sandboxID"], made["envdAccessToken"]
    await write_file(a, sid, token, "/home/user/travels.txt", b"across nodes")
    assert (await a.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204
    return sid, token


async def moved_and_fenced(b: Served, sid: str, token: str) -> None:
    """A connect through b resumes the sandbox there; a's last view of its row is fenced; history says so."""
    rows = Sandboxes(b.manager.db)
    before = await rows.get(sid)
    assert before is not None and before.node_id != "b"
    status, resumed = await b.call("POST", f"/sandboxes/{sid}/connect", {"timeout": 60})
    assert status == 201, resumed
    assert await read_file(b, sid, token, "/home/user/travels.txt") == b"across nodes"
    moved = await rows.get(sid)
    assert moved is not None and (moved.node_id, moved.epoch) == ("b", before.epoch + 1)
    with pytest.raises(Fenced):  # what the old owner held of it is refused
        await rows.transition(sid, before.version, before.epoch, state="running")
    events = b.manager.recorder.events
    moves = [e.data for e in await events.read(sid) if e.kind == "sandbox.node.moved"]
    assert [(m["from"], m["to"]) for m in moves] == [(before.node_id, "b")]
    assert (await events.verify(sid)).ok


async def test_a_paused_session_moves_once_its_node_left(postgres: PostgresServer,  # noqa: F811
                                                         tmp_path: Path) -> None:
    url = postgres.createdb(f"takeover_{secrets.token_hex(6)}")
    store = f"file://{tmp_path / 'store'}"
    async with contextlib.AsyncExitStack() as on_a:
        a = await on_a.enter_async_context(serving(node="a", db_url=url, store_url=store, lease=LEASE))
        sid, token = await paused_on(a)
        async with serving(node="b", db_url=url, store_url=store, key=a.key, lease=LEASE) as b:
            status, info = await b.call("GET", f"/sandboxes/{sid}")  # a is live: b relays to it, takes nothing
            assert status == 200 and info["state"] == "paused" and sid not in b.manager.records
            async with b.http.post(f"{b.url}/sandboxes/{sid}/connect", json={"timeout": 60},
                                   headers={**b.headers, "X-KeepState-Relayed": "c"}) as r:
                assert r.status == 421  # misdirected to b: b takes nothing from a live node
            assert sid not in b.manager.records
            await on_a.aclose()  # a stops cleanly: it leaves; its paused sandbox's row and checkpoint stay
            await moved_and_fenced(b, sid, token)


async def test_a_paused_session_moves_once_its_node_is_declared_dead(postgres: PostgresServer,  # noqa: F811
                                                                     tmp_path: Path) -> None:
    url = postgres.createdb(f"takeover_{secrets.token_hex(6)}")
    store = f"file://{tmp_path / 'store'}"
    async with serving(node="a", db_url=url, store_url=store, lease=LEASE) as a:
        sid, token = await paused_on(a)
        assert a.app is not None
        from keepstate.api.nodes import MEMBERSHIP

        a.app[MEMBERSHIP].renew_once = _never  # type: ignore[method-assign]  # a hangs: its lease runs out
        async with serving(node="b", db_url=url, store_url=store, key=a.key, lease=LEASE) as b:
            nodes = Nodes(b.manager.db)
            while (await nodes.get("a")).state != "dead":  # type: ignore[union-attr]  # b's reaper, in seconds
                await asyncio.sleep(0.1)
            await moved_and_fenced(b, sid, token)


async def _never() -> None:
    """A renewal that never reaches the database (a node frozen, or cut off from it)."""


async def test_a_running_session_outlives_a_node_that_stops_with_on_stop_pause(postgres: PostgresServer,  # noqa: F811
                                                                              tmp_path: Path) -> None:
    """Rolling a node (E2B's orchestrators kill their sandboxes then, e2b-dev/infra#2397): a node of a cluster that
    stops pauses each running sandbox to the store first and leaves; its sessions resume on another node."""
    url = postgres.createdb(f"takeover_{secrets.token_hex(6)}")
    store = f"file://{tmp_path / 'store'}"
    runtime = FakeRuntime()  # a's host: it outlives a's server, and is looked at after a stops
    try:
        async with contextlib.AsyncExitStack() as on_a:
            a = await on_a.enter_async_context(serving(node="a", db_url=url, store_url=store, lease=LEASE,
                                                       runtime=runtime, reap_on_exit=False))  # on_stop: "pause"
            status, made = await a.call("POST", "/sandboxes", {"templateID": "base", "timeout": 300})
            assert status == 201, made
            sid, token = made["sandboxID"], made["envdAccessToken"]
            await write_file(a, sid, token, "/home/user/travels.txt", b"across nodes")
            async with serving(node="b", db_url=url, store_url=store, key=a.key, lease=LEASE) as b:
                instance = a.manager.records[sid].runtime_name
                assert runtime.statuses().get(instance) == "running"
                await on_a.aclose()  # SIGTERM
                row = await Sandboxes(b.manager.db).get(sid)
                assert row is not None and (row.node_id, row.state) == ("a", "paused")
                assert runtime.statuses().get(instance, "gone") == "gone"  # paused to the store, standby released
                await moved_and_fenced(b, sid, token)
    finally:
        runtime.close()
