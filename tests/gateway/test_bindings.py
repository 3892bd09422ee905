"""Runs told apart by the caller's address: sandbox instances keep the token of the run they were started in.

Sandbox instances are played by loopback addresses other than 127.0.0.1 (the host's own), which Linux lets a
client bind to; the gateway listens on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from keepstate.db.repos.ledger import Ledger
from keepstate.gateway.gateway import BindingPending
from keepstate.testing import FakeProvider

from .conftest import Env, standalone_gateway


def chat(text: str) -> dict[str, Any]:
    return {"model": "fake-gpt", "messages": [{"role": "user", "content": text}]}


async def post_from(url: str, ip: str, token: str, body: dict[str, Any], path: str = "/v1/chat/completions",
                    **headers: str) -> tuple[int, dict[str, str], bytes]:
    connector = aiohttp.TCPConnector(local_addr=(ip, 0))
    async with aiohttp.ClientSession(connector=connector) as s:
        async with s.post(url + path, json=body, headers={"authorization": f"Bearer {token}", **headers}) as r:
            return r.status, dict(r.headers), await r.read()


async def last_entry(env: Env) -> dict[str, Any]:
    return (await env.gateway.ledger.entries())[-1]


async def run_id(env: Env, token: str) -> str:
    run = await env.gateway.run_of(token)
    assert run is not None
    return run.run_id


async def test_the_address_decides_the_run_whatever_family_token_it_carries(env: Env) -> None:
    first = await env.token("s", "sbx-1", source_ip="127.0.0.2")
    status, _, _ = await post_from(env.url, "127.0.0.2", first, chat("hello"))
    assert status == 200 and (await last_entry(env))["run_id"] == await run_id(env, first)
    # restored elsewhere: its processes still send the first token
    second = await env.token("s", "sbx-1", checkpoint_id="ckpt-1", source_ip="127.0.0.3")
    status, _, _ = await post_from(env.url, "127.0.0.3", first, chat("again"))
    assert status == 200 and (await last_entry(env))["run_id"] == await run_id(env, second)


async def test_a_token_outside_the_family_is_refused_in_the_providers_shape(env: Env) -> None:
    await env.token("s", "sbx-1", source_ip="127.0.0.2")
    stranger = await env.token("other", "sbx-9")
    status, _, body = await post_from(env.url, "127.0.0.2", stranger, chat("x"))
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    msg = {"model": "claude-fake", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    status, _, body = await post_from(env.url, "127.0.0.2", stranger, msg, "/v1/messages",
                                      **{"anthropic-version": "2023-06-01"})
    assert status == 401 and json.loads(body) == {"type": "error", "error": {
        "type": "authentication_error", "message": "Invalid or missing KeepState gateway token."}}
    status, _, _ = await post_from(env.url, "127.0.0.2", "ksgw-made-up", chat("x"))
    assert status == 401
    assert env.fake.stats().requests == 0


async def test_ancestors_tokens_are_accepted_descendants_are_not(env: Env) -> None:
    parent = await env.token("parent", "sbx-p", source_ip="127.0.0.2")
    child = await env.token("child", "sbx-c", checkpoint_id="ck-1", parent_session_id="parent", source_ip="127.0.0.3")
    grand = await env.token("grand", "sbx-g", checkpoint_id="ck-2", parent_session_id="child", source_ip="127.0.0.4")
    status, _, _ = await post_from(env.url, "127.0.0.4", parent, chat("from the grandparent's process"))
    assert status == 200 and (await last_entry(env))["session_id"] == "grand"
    status, _, _ = await post_from(env.url, "127.0.0.4", child, chat("from the parent's process"))
    assert status == 200 and (await last_entry(env))["session_id"] == "grand"
    assert (await post_from(env.url, "127.0.0.3", grand, chat("x")))[0] == 401
    assert (await post_from(env.url, "127.0.0.2", child, chat("x")))[0] == 401
    # a later run of the child (a resume) need not repeat its parent
    await env.token("child", "sbx-c", checkpoint_id="ck-3", source_ip="127.0.0.5")
    status, _, _ = await post_from(env.url, "127.0.0.5", parent, chat("resumed child"))
    assert status == 200 and (await last_entry(env))["session_id"] == "child"


async def test_a_later_binding_supersedes_and_end_run_unbinds(env: Env) -> None:
    gone = await env.token("s-old", "sbx-old", source_ip="127.0.0.6")
    new = await env.token("s-new", "sbx-new", source_ip="127.0.0.6")  # the address was given to another sandbox
    assert (await post_from(env.url, "127.0.0.6", gone, chat("x")))[0] == 401
    status, _, _ = await post_from(env.url, "127.0.0.6", new, chat("x"))
    assert status == 200 and (await last_entry(env))["session_id"] == "s-new"
    await env.gateway.end_run(new)
    assert "127.0.0.6" not in await env.gateway.ledger.bindings()
    assert (await post_from(env.url, "127.0.0.6", new, chat("x")))[0] == 401


async def test_unbound_addresses_fall_back_to_the_token(env: Env) -> None:
    standalone = await env.token("solo", "sbx-solo")  # registered without an address
    status, _, _ = await post_from(env.url, "127.0.0.7", standalone, chat("x"))
    assert status == 200 and (await last_entry(env))["session_id"] == "solo"
    bound = await env.token("s", "sbx-1", source_ip="127.0.0.2")
    status, _, _ = await post_from(env.url, "127.0.0.1", bound, chat("host caller"))  # the host itself
    assert status == 200 and (await last_entry(env))["run_id"] == await run_id(env, bound)


async def test_a_restored_instance_waits_for_its_binding(env: Env) -> None:
    first = await env.token("s", "sbx-1", source_ip="127.0.0.2")
    pending = asyncio.Event()
    caller = env.gateway._caller  # what each look of the handler's wait for a binding asks

    async def spy(token: str | None, peer: str | None = None) -> Any:
        try:
            return await caller(token, peer)
        except BindingPending:
            pending.set()
            raise

    env.gateway._caller = spy  # type: ignore[method-assign]
    call = asyncio.create_task(post_from(env.url, "127.0.0.8", first, chat("right after restore")))
    async with asyncio.timeout(10):
        await pending.wait()
    second = await env.token("s", "sbx-1", checkpoint_id="ck", source_ip="127.0.0.8")
    status, _, _ = await call
    assert status == 200 and (await last_entry(env))["run_id"] == await run_id(env, second)


async def test_an_instance_never_bound_gets_a_retryable_503(env: Env) -> None:
    env.gateway.config.binding_wait_s = 0.2
    first = await env.token("s", "sbx-1", source_ip="127.0.0.2")
    status, headers, body = await post_from(env.url, "127.0.0.9", first, chat("x"))
    assert status == 503 and headers["x-should-retry"] == "true"
    assert json.loads(body)["error"]["code"] == "sandbox_not_bound"
    assert env.fake.stats().requests == 0


async def test_calls_made_after_the_thaw_are_not_in_the_mark(env: Env) -> None:
    """A snapshot: the sandbox is frozen, thawed, goes on calling; the mark is written after all that."""
    t1 = await env.token("s", "sbx-1", source_ip="127.0.0.2")
    for i in range(2):
        await post_from(env.url, "127.0.0.2", t1, chat(f"step {i}"))
    frozen = time.time()
    for i in range(2, 4):
        await post_from(env.url, "127.0.0.2", t1, chat(f"step {i}"))
    assert await env.gateway.mark_checkpoint("s", "ck-window") == 0  # no freeze times: a window the first call narrows
    assert await env.gateway.mark_checkpoint("s", "ck-exact", frozen, frozen) == 2
    assert await env.gateway.mark_checkpoint("s", "ck-later") == 2  # an earlier mark of the run is the floor
    for checkpoint, ip in (("ck-exact", "127.0.0.3"), ("ck-window", "127.0.0.4")):
        await env.token("s", "sbx-1", checkpoint_id=checkpoint, source_ip=ip)
        sources = [(await post_from(env.url, ip, t1, chat(f"step {i}")))[1]["x-keepstate-source"] for i in (2, 3)]
        assert sources == ["store", "store"]
    assert env.fake.stats().calls == 4


async def test_a_call_in_flight_at_the_freeze_is_answered_from_the_store_after_restore(env: Env) -> None:
    t1 = await env.token("s", "sbx-1", source_ip="127.0.0.2")
    await post_from(env.url, "127.0.0.2", t1, chat("step 0"))
    env.fake.first_token_s = 0.3
    in_flight = asyncio.create_task(post_from(env.url, "127.0.0.2", t1, chat("step 1")))
    async with asyncio.timeout(10):
        while env.fake.stats().requests < 2:
            await asyncio.sleep(0.01)
    frozen = time.time()
    await in_flight  # delivered after the freeze: the image never saw the answer
    env.fake.first_token_s = 0.0
    assert await env.gateway.mark_checkpoint("s", "ck", frozen, frozen) == 1
    await env.gateway.end_run(t1)  # paused: the instance is gone
    await env.token("s", "sbx-1", checkpoint_id="ck", source_ip="127.0.0.3")
    # the restored agent's request died with the old network: it comes back as an SDK retry
    retried = await post_from(env.url, "127.0.0.3", t1, chat("step 1"), **{"x-stainless-retry-count": "1"})
    fresh = await post_from(env.url, "127.0.0.3", t1, chat("step 2"))
    assert [retried[1]["x-keepstate-source"], fresh[1]["x-keepstate-source"]] == ["store", "upstream"]
    assert env.fake.stats().calls == 3


async def test_bindings_are_shared_with_a_standalone_gateway_process(fake: FakeProvider, tmp_path: Path) -> None:
    async with standalone_gateway(fake, tmp_path) as gw:
        first = await gw.lead.register_run("s", "sbx-1", None, None, source_ip="127.0.0.2")
        second = await gw.lead.register_run("s", "sbx-1", None, "ck", source_ip="127.0.0.3")
        async with asyncio.timeout(30):
            while True:
                try:
                    status, _, _ = await post_from(gw.url, "127.0.0.3", first, chat("x"))
                    break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.1)
        assert status == 200
        run = await gw.lead.run_of(second)
        assert run is not None and [e["run_id"] for e in await Ledger(gw.db, "reader").entries()] == [run.run_id]
