"""Budgets at the HTTP level: concurrent calls that could overrun are refused before going upstream; on SQLite and
on PostgreSQL."""

from __future__ import annotations

import asyncio

import openai
import pytest

from keepstate.db.engine import Database

from .conftest import Env


@pytest.fixture
def gw_database(database: Database) -> Database:
    return database


async def test_concurrent_calls_cannot_overrun_a_session_budget(env: Env) -> None:
    env.fake.first_token_s = 0.5  # the first call is still upstream when the last is decided, on any database
    token = await env.token("budgeted", key="k-b")
    body = {"model": "fake-gpt", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1000}
    # Worst case of one call: ~80 bytes of input at $1/M + 1000 output tokens at $2/M, about $0.00208.
    await env.gateway.set_budget("session", "budgeted", 0.003)
    results = await asyncio.gather(*(env.post(token, "/v1/chat/completions", {**body, "user": str(i)})
                                     for i in range(5)))
    statuses = sorted(r[0] for r in results)
    assert statuses == [200, 429, 429, 429, 429]
    refused = next(r for r in results if r[0] == 429)
    assert refused[1]["x-should-retry"] == "false" and b"insufficient_quota" in refused[2]
    assert env.fake.stats().requests == 1
    b = await env.gateway.budget("session", "budgeted")
    assert b is not None and 0 < b["spent"] <= 0.003 and b["reserved"] == 0


async def test_sdk_does_not_retry_a_budget_refusal_and_output_is_capped(env: Env) -> None:
    await env.gateway.set_budget("key", "k-c", 0.0001)
    env.gateway.config.default_max_output_tokens = 3
    oa = openai.AsyncOpenAI(base_url=env.url + "/v1", api_key=await env.token("s-c", key="k-c"), max_retries=3)
    r = await oa.chat.completions.create(model="fake-gpt", messages=[{"role": "user", "content": "cap me"}])
    assert r.usage is not None and r.usage.completion_tokens <= 3  # the gateway set the cap upstream
    await env.gateway.set_budget("key", "k-c", 0.0)
    with pytest.raises(openai.RateLimitError):
        await oa.chat.completions.create(model="fake-gpt", messages=[{"role": "user", "content": "more"}])
    assert env.fake.stats().requests == 1


async def test_unpriced_model_under_budget_is_refused(env: Env) -> None:
    env.gateway.config.providers[0] = env.gateway.config.providers[0].__class__(
        "fake-openai", "openai", env.fake.openai_base_url, "sk-host-secret", ("fake-*", "free-*"))
    await env.gateway.set_budget("session", "s-u", 1.0)
    status, _, body = await env.post(await env.token("s-u"), "/v1/chat/completions",
                                     {"model": "free-model", "messages": []})
    assert status == 429 and b"no price" in body and env.fake.stats().requests == 0
