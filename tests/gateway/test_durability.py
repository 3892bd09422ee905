"""Durability at the HTTP level: disconnects, retries, and runs resumed from a checkpoint re-issuing their calls."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import openai
import pytest

from keepstate.db.errors import DatabaseUnavailable
from keepstate.gateway.ledger import reconcile

from .conftest import Env


def chat(text: str, stream: bool = False) -> dict[str, Any]:
    return {"model": "fake-gpt", "messages": [{"role": "user", "content": text}], "stream": stream}


async def wait_for(pred: Any, limit: float = 5.0) -> None:
    async with asyncio.timeout(limit):
        while not pred():
            await asyncio.sleep(0.005)


async def kill_mid_stream(env: Env, token: str, body: dict[str, Any]) -> bytes:
    """A client that reads the first bytes of a stream and dies."""
    async with aiohttp.ClientSession() as s:
        async with s.post(env.url + "/v1/chat/completions", json=body,
                          headers={"authorization": f"Bearer {token}"}) as r:
            assert r.status == 200
            return await r.content.readany()


def provider_counts(env: Env) -> dict[str, dict[str, Any]]:
    return {"fake-openai": env.fake.stats().to_dict()}


async def test_client_killed_mid_stream_then_retry_served_from_store(env: Env) -> None:
    env.fake.chunk_s = 0.02
    token = await env.token()
    first = await kill_mid_stream(env, token, chat("long story", stream=True))
    assert first.startswith(b"data: ")
    await env.gateway.drain()
    assert env.fake.stats().calls == 1
    (call,) = await env.gateway.ledger.calls()
    assert call.status == "done" and call.usage is not None and call.usage["output_tokens"] > 0
    status, headers, body = await env.post(token, "/v1/chat/completions", chat("long story", stream=True),
                                           **{"x-stainless-retry-count": "1"})
    assert status == 200 and headers["x-keepstate-source"] == "store"
    assert body.startswith(first) and body.rstrip().endswith(b"data: [DONE]")
    assert env.fake.stats().calls == 1
    kinds = [(e["kind"], e["cost_nano"] > 0) for e in await env.gateway.ledger.entries()]
    assert kinds == [("upstream", True), ("store", False)]
    assert await reconcile(env.gateway.ledger, env.gateway.prices, provider_counts(env)) == []


async def test_retry_joins_call_in_flight(env: Env) -> None:
    env.fake.first_token_s = 0.3
    token = await env.token()
    first = asyncio.create_task(env.post(token, "/v1/chat/completions", chat("q")))
    await wait_for(lambda: env.fake.stats().requests == 1)
    status, headers, body = await env.post(token, "/v1/chat/completions", chat("q"), **{"x-stainless-retry-count": "2"})
    assert status == 200 and headers["x-keepstate-source"] == "joined"
    s1, h1, b1 = await first
    assert b1 == body and h1["x-keepstate-call-key"] == headers["x-keepstate-call-key"]
    assert env.fake.stats().requests == 1
    entries = await env.gateway.ledger.entries()
    assert [e["kind"] for e in entries] == ["upstream", "joined"]
    assert entries[1]["original_entry_id"] == entries[0]["entry_id"]


async def test_sdk_timeouts_and_retries_make_one_upstream_call(env: Env) -> None:
    env.fake.first_token_s = 0.4
    token = await env.token()
    oa = openai.AsyncOpenAI(base_url=env.url + "/v1", api_key=token, timeout=0.15, max_retries=4)
    r = await oa.chat.completions.create(model="fake-gpt", messages=[{"role": "user", "content": "retry me"}])
    assert r.choices[0].message.content
    await env.gateway.drain()
    assert env.fake.stats().requests == 1
    kinds = {e["kind"] for e in await env.gateway.ledger.entries()}
    assert "upstream" in kinds and kinds <= {"upstream", "joined", "store"}


async def test_same_body_twice_is_two_calls(env: Env) -> None:
    token = await env.token()
    for _ in range(2):
        status, headers, _ = await env.post(token, "/v1/chat/completions", chat("again"))
        assert headers["x-keepstate-source"] == "upstream"
    assert env.fake.stats().calls == 2


async def test_resume_from_checkpoint_reissues_calls_from_store(env: Env) -> None:
    env.fake.chunk_s = 0.01
    r1 = await env.token("s1", "sbx-1")
    for i in range(2):
        await env.post(r1, "/v1/chat/completions", chat(f"step {i}"))
    frozen = time.time()
    assert await env.gateway.mark_checkpoint("s1", "ckpt-A", frozen, frozen) == 2
    for i in range(2, 4):
        await env.post(r1, "/v1/chat/completions", chat(f"step {i}"))
    await kill_mid_stream(env, r1, chat("step 4", stream=True))  # the sandbox dies mid-call
    await env.gateway.end_run(r1)
    await env.gateway.drain()
    assert env.fake.stats().calls == 5

    r2 = await env.token("s1", "sbx-2", checkpoint_id="ckpt-A")
    sources = []
    for i in range(2, 6):
        status, headers, body = await env.post(r2, "/v1/chat/completions", chat(f"step {i}", stream=(i == 4)))
        assert status == 200
        sources.append(headers["x-keepstate-source"])
    assert sources == ["store", "store", "store", "upstream"]
    assert env.fake.stats().calls == 6
    upstream = [e for e in await env.gateway.ledger.entries() if e["kind"] == "upstream"]
    assert len(upstream) == 6 == len(await env.gateway.ledger.calls())
    assert await reconcile(env.gateway.ledger, env.gateway.prices, provider_counts(env)) == []

    # A third life from the same checkpoint whose agent changed its second call: one new call, one divergence.
    r3 = await env.token("s1", "sbx-3", checkpoint_id="ckpt-A")
    got = []
    for text in ("step 2", "step 3 but different", "step 4"):
        _, headers, _ = await env.post(r3, "/v1/chat/completions", chat(text, stream=(text == "step 4")))
        got.append(headers["x-keepstate-source"])
    assert got == ["store", "upstream", "store"]
    run3 = await env.gateway.run_of(r3)
    assert run3 is not None
    (div,) = await env.gateway.ledger.divergences(run3.run_id)
    assert div["ordinal"] == 1
    assert env.fake.stats().calls == 7


async def test_restart_without_checkpoint_replays_from_start(env: Env) -> None:
    for run in range(2):
        token = await env.token("s2", f"sbx-{run}")
        _, h, _ = await env.post(token, "/v1/chat/completions", chat("boot"))
        assert h["x-keepstate-source"] == ("upstream" if run == 0 else "store")
    assert env.fake.stats().calls == 1


async def test_forks_diverge_by_default_and_replay_on_request(env: Env) -> None:
    parent = await env.token("parent", "sbx-p")
    await env.post(parent, "/v1/chat/completions", chat("before"))
    await env.gateway.mark_checkpoint("parent", "ckpt-F")
    await env.post(parent, "/v1/chat/completions", chat("after"))
    diverging = await env.token("fork-1", "sbx-f1", checkpoint_id="ckpt-F", parent_session_id="parent")
    _, h, _ = await env.post(diverging, "/v1/chat/completions", chat("after"))
    assert h["x-keepstate-source"] == "upstream"
    replaying = await env.token("fork-2", "sbx-f2", checkpoint_id="ckpt-F", mode="replay", parent_session_id="parent")
    _, h, _ = await env.post(replaying, "/v1/chat/completions", chat("after"))
    assert h["x-keepstate-source"] == "store"
    fork_entries = await env.gateway.ledger.entries("fork-2")
    assert [(e["kind"], e["cost_nano"]) for e in fork_entries] == [("store", 0)]
    assert env.fake.stats().calls == 3


async def test_idempotency_key_wins_across_runs(env: Env) -> None:
    a, b = await env.token("s3", "x"), await env.token("s3", "y")
    _, h1, b1 = await env.post(a, "/v1/chat/completions", chat("one"), **{"idempotency-key": "job-7"})
    _, h2, b2 = await env.post(b, "/v1/chat/completions", chat("one"), **{"idempotency-key": "job-7"})
    assert (h1["x-keepstate-source"], h2["x-keepstate-source"]) == ("upstream", "store") and b1 == b2
    _, h3, _ = await env.post(b, "/v1/chat/completions", chat("one"), **{"idempotency-key": "stainless-python-retry-1"})
    assert h3["x-keepstate-source"] == "upstream"  # SDK-made keys are not identities


async def test_ended_run_token_is_refused(env: Env) -> None:
    token = await env.token()
    await env.gateway.end_run(token)
    status, _, body = await env.post(token, "/v1/chat/completions", chat("x"))
    assert status == 401 and b"invalid_api_key" in body


async def test_an_outcome_is_stored_once_the_database_answers_again(env: Env,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    finish, failed = env.gateway.ledger.finish_upstream, list[bool]()

    async def flaky(*args: Any, **kw: Any) -> int | None:
        if not failed:
            failed.append(True)
            raise DatabaseUnavailable("sqlite:///x: database is locked")
        return await finish(*args, **kw)

    monkeypatch.setattr(env.gateway.ledger, "finish_upstream", flaky)
    status, _, _ = await env.post(await env.token(), "/v1/chat/completions", chat("x"))
    assert status == 200 and failed == [True]
    (entry,) = await env.gateway.ledger.entries()
    (call,) = await env.gateway.ledger.calls()
    assert entry["outcome"] == "ok" and call.status == "done" and call.ok_entry_id == entry["entry_id"]
