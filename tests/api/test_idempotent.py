"""Idempotent creates (docs/design/idempotency.md), on an in-process server (fake runtime): with the stock SDK as the
client, a create whose answer a load balancer lost (a 502 after the server answered) and that the SDK retries with
its key makes one sandbox; ten concurrent creates with one key make one; a key used for another request is a 409
`idempotency_request_mismatch`; one still running is waited for, then `idempotency_in_progress`; a retry after the
first attempt's server is gone answers what that attempt left, exactly as docs/design/idempotency.md says."""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from e2b import AsyncSandbox

from keepstate.api import idempotent
from keepstate.db.records import IdempotencyRecord
from keepstate.db.repos.idempotency import Idempotency
from keepstate.db.repos.ledger_claims import node_owner

from ..sandbox.conftest import Served, free_port, serving

BODY = {"templateID": "base", "timeout": 300}


async def create(s: Served, key: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, str], Any]:
    async with s.http.post(s.url + "/v2/sandboxes", json=body or BODY,
                           headers={**s.headers, "Idempotency-Key": key}) as r:
        return r.status, dict(r.headers), await r.json()


def listed(s: Served) -> set[str]:
    return {r.sandbox_id for r in s.manager.listed()}


class LosingBalancer:
    """A load balancer in front of the server that loses the answer of the first create it relays (the server made
    the sandbox and answered; the client gets a 502), and relays everything else."""

    def __init__(self, backend: str) -> None:
        self.backend, self.lost, self.creates = backend, 0, 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with aiohttp.ClientSession() as http, \
                http.request(request.method, self.backend + str(request.rel_url), data=body,
                             headers=headers) as answer:
            data = await answer.read()
            if request.path.endswith("/sandboxes") and request.method == "POST":
                self.creates += 1
                if self.lost == 0:
                    self.lost += 1
                    return web.Response(status=502, text="upstream connection reset")
            return web.Response(body=data, status=answer.status,
                                content_type=answer.content_type if data else None)


async def test_the_sdk_retrying_a_create_whose_answer_was_lost_gets_one_sandbox() -> None:
    async with serving(pool_size=0) as s:
        lb = LosingBalancer(s.url)
        runner = web.AppRunner(_app(lb))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", lb.port).start()
        try:
            key = f"retry-{secrets.token_hex(8)}"
            sbx = await AsyncSandbox.create(api_key=s.key, api_url=lb.url, sandbox_url=s.url, idempotency_key=key,
                                            timeout=300)
            assert (lb.lost, lb.creates) == (1, 2)  # the first answer lost, the SDK retried once with the key
            assert listed(s) == {sbx.sandbox_id}  # one sandbox, the one the retry was told about
            again = await AsyncSandbox.create(api_key=s.key, api_url=lb.url, sandbox_url=s.url, idempotency_key=key,
                                              timeout=300)
            assert again.sandbox_id == sbx.sandbox_id and listed(s) == {sbx.sandbox_id}
        finally:
            await runner.cleanup()


def _app(lb: LosingBalancer) -> web.Application:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", lb.handle)
    return app


async def test_ten_concurrent_creates_with_one_key_make_one_sandbox_and_a_key_is_bound_to_its_request() -> None:
    async with serving(pool_size=0) as s:
        key = f"ten-{secrets.token_hex(8)}"
        answers = await asyncio.gather(*(create(s, key) for _ in range(10)))
        assert {status for status, _, _ in answers} == {201}
        ids = {body["sandboxID"] for _, _, body in answers}
        tokens = {body["envdAccessToken"] for _, _, body in answers}
        assert len(ids) == 1 and len(tokens) == 1 and listed(s) == ids
        (sid,) = ids
        # The same answer after a pause, and after a kill: the key remembers the create.
        assert (await s.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204
        assert (await create(s, key))[2]["sandboxID"] == sid
        assert (await s.call("DELETE", f"/sandboxes/{sid}"))[0] == 204
        status, _, body = await create(s, key)
        assert status == 201 and body["sandboxID"] == sid and not listed(s)
        # Another body, or another route, with the same key: refused, nothing made.
        status, headers, body = await create(s, key, {**BODY, "timeout": 301})
        assert status == 409 and body["error_code"] == "idempotency_request_mismatch"
        assert headers.get("Should-Retry") != "true"  # the SDK retries no 409 unmarked
        async with s.http.post(s.url + "/sandboxes", json=BODY, headers={**s.headers, "Idempotency-Key": key}) as r:
            assert r.status == 409 and (await r.json())["error_code"] == "idempotency_request_mismatch"
        status, _, body = await create(s, "Not-Lower-Case")
        assert status == 400 and "Idempotency-Key" in body["message"]
        assert not listed(s)


async def test_a_retry_waits_for_the_create_in_progress_then_is_told_to_come_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(pool_size=0) as s:
        gate = asyncio.Event()
        real = s.manager.create

        async def slow(*args: Any, **kwargs: Any) -> Any:
            await gate.wait()
            return await real(*args, **kwargs)

        s.manager.create = slow  # type: ignore[method-assign]
        key = f"slow-{secrets.token_hex(8)}"
        first = asyncio.ensure_future(create(s, key))
        monkeypatch.setattr(idempotent, "IN_PROGRESS_WAIT_S", 0.3)
        await asyncio.sleep(0.1)
        status, headers, body = await create(s, key)  # still in progress after its wait
        assert status == 409 and body["error_code"] == "idempotency_in_progress"
        assert headers["Should-Retry"] == "true" and int(headers["Retry-After"]) >= 1
        monkeypatch.setattr(idempotent, "IN_PROGRESS_WAIT_S", 30.0)
        second = asyncio.ensure_future(create(s, key))  # waits, and gets the first one's answer
        await asyncio.sleep(0.2)
        gate.set()
        (status1, _, body1), (status2, _, body2) = await first, await second
        assert status1 == status2 == 201 and body1 == body2 and listed(s) == {body1["sandboxID"]}


async def test_a_failed_create_frees_its_key() -> None:
    async with serving(pool_size=0) as s:
        key = f"fails-{secrets.token_hex(8)}"
        status, _, body = await create(s, key, {**BODY, "templateID": "no-such-template"})
        assert status == 404, body
        status, _, body = await create(s, key, {**BODY, "templateID": "no-such-template"})
        assert status == 404, body  # tried again, not answered from a record
        assert await Idempotency(s.manager.db).get(await _api_key_id(s), key) is None


async def test_a_retry_after_the_first_attempts_server_is_gone_answers_what_it_left() -> None:
    """The first attempt's server (an incarnation that no longer holds its row: it crashed and this one started)
    left an in-progress key: a retry takes it over and answers the sandbox it made, makes it if it made nothing, or
    says the outcome is unknown if it made one that is gone since."""
    async with serving(pool_size=0) as s:
        keys = Idempotency(s.manager.db)
        gone = node_owner("local", 0)  # no incarnation 0 ever holds a row
        scope = await _api_key_id(s)
        made = (await s.call("POST", "/sandboxes", BODY))[1]

        async def left(key: str, sandbox_id: str) -> None:
            digest = idempotent.digest(_request("/v2/sandboxes"), json.dumps(BODY).encode())
            await keys.begin(IdempotencyRecord(api_key_id=scope, key=key, digest=digest, sandbox_id=sandbox_id,
                                               state="in_progress", owner=gone), ttl_s=60)

        await left("made-it", made["sandboxID"])  # the crash came after the sandbox was recorded
        status, _, body = await create(s, "made-it")
        assert status == 201 and body["sandboxID"] == made["sandboxID"]
        assert body["envdAccessToken"] == made["envdAccessToken"]
        assert (await keys.get(scope, "made-it")).state == "done"  # type: ignore[union-attr]

        chosen = "idem" + secrets.token_hex(8)
        await left("made-nothing", chosen)  # the crash came before anything was recorded
        status, _, body = await create(s, "made-nothing")
        assert status == 201 and body["sandboxID"] == chosen and chosen in listed(s)

        assert (await s.call("DELETE", f"/sandboxes/{made['sandboxID']}"))[0] == 204
        await left("made-and-lost", made["sandboxID"])  # made, then gone before anyone learnt its tokens
        status, _, body = await create(s, "made-and-lost")
        assert status == 409 and body["error_code"] == "idempotency_outcome_unknown"
        assert len(listed(s)) == 1


async def _api_key_id(s: Served) -> str:
    from keepstate.apikeys import find as find_key
    from keepstate.db.repos import Keys

    found = await find_key(Keys(s.manager.db), s.key)
    assert found is not None
    return str(found.id)


def _request(path: str) -> Any:
    class _R:
        method = "POST"

    r = _R()
    r.path = path  # type: ignore[attr-defined]
    return r
