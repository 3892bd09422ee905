"""Chaos: 240 calls from 8 concurrent agents with random client disconnects, SDK retries (after injected upstream
errors and client timeouts) and budgets under pressure. Whatever happens: provider calls == ledger upstream
entries == distinct call keys; no budget is overrun; no usage is lost; reconcile is clean."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from keepstate.db.engine import Database
from keepstate.gateway import GATEWAY
from keepstate.gateway.ledger import reconcile
from keepstate.testing import FakeProvider, Fault

from .conftest import HOST_KEY, make_config, start_gateway


@pytest.fixture
def gw_database(database: Database) -> Database:
    """SQLite and PostgreSQL: budgets and billing under load are what the database keeps."""
    return database

AGENTS, CALLS = 8, 30
SESSION_LIMIT_USD = 0.0021  # roughly half of a session's calls fit, by their worst case
KEY_LIMIT_USD = 0.0100  # shared by all agents: concurrent pressure on one budget


def body(agent: int, i: int, stream: bool, anthropic: bool) -> dict[str, Any]:
    msgs = [{"role": "user", "content": f"agent {agent} step {i} " + "word " * (i % 7)}]
    if anthropic:
        return {"model": "claude-fake-1", "max_tokens": 24, "messages": msgs, "stream": stream}
    return {"model": "fake-gpt", "messages": msgs, "stream": stream}


async def agent(url: str, token: str, n: int, rng: random.Random, outcomes: dict[str, int]) -> None:
    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key=token, max_retries=3, timeout=5.0)
    async with aiohttp.ClientSession() as s:
        for i in range(CALLS):
            anthropic, stream = rng.random() < 0.3, rng.random() < 0.6
            b = body(n, i, stream, anthropic)
            path = "/v1/messages" if anthropic else "/v1/chat/completions"
            roll = rng.random()
            if roll < 0.25 and not anthropic:
                try:  # the official SDK, retrying by itself after injected 500s
                    await sdk.chat.completions.create(**{k: v for k, v in b.items() if k != "stream"})
                    outcomes["sdk_ok"] += 1
                except openai.APIStatusError as e:
                    outcomes[f"sdk_{e.status_code}"] += 1
                continue
            headers = {"authorization": f"Bearer {token}"}
            if roll < 0.55:  # the client dies mid-answer, then its SDK retries the same body
                try:
                    async with s.post(url + path, json=b, headers=headers) as r:
                        if r.status != 200:
                            outcomes[f"refused_{r.status}"] += 1
                            continue
                        await r.content.readany()
                except aiohttp.ClientError:
                    pass
                headers["x-stainless-retry-count"] = "1"
            async with s.post(url + path, json=b, headers=headers) as r:
                data = await r.read()
                if r.status == 200:
                    outcomes["ok"] += 1
                    assert (not stream) or data.rstrip().endswith((b"[DONE]", b'{"type": "message_stop"}'))
                else:
                    outcomes[f"refused_{r.status}"] += 1


@pytest.mark.timeout(120)
async def test_chaos(tmp_path: Path, gw_database: Database) -> None:
    rng = random.Random(4)
    async with FakeProvider(first_token_s=0.003, chunk_s=0.001, api_key=HOST_KEY) as fake:
        cfg = make_config(fake, tmp_path, default_max_output_tokens=32)
        cfg.key_budgets_usd = {"shared-key": KEY_LIMIT_USD}
        cfg.session_budgets_usd = {f"s{n}": SESSION_LIMIT_USD for n in range(AGENTS)}
        runner, url = await start_gateway(cfg, gw_database)
        gw = runner.app[GATEWAY]
        try:
            fake.inject(Fault(status=500, endpoint="chat"), times=6)
            fake.inject(Fault(status=503, endpoint="messages"), times=3)
            outcomes: dict[str, int] = defaultdict(int)
            tokens = [await gw.register_run(f"s{n}", f"sbx{n}", "shared-key", None) for n in range(AGENTS)]
            await asyncio.gather(*(agent(url, t, n, random.Random(rng.random()), outcomes)
                                   for n, t in enumerate(tokens)))
            await gw.drain()

            stats, store = fake.stats(), gw.ledger
            entries = await store.entries()
            upstream = [e for e in entries if e["kind"] == "upstream"]
            ok = [e for e in upstream if e["outcome"] == "ok"]
            done_keys = {c.call_key for c in await store.calls() if c.status == "done"}
            assert sum(outcomes.values()) == AGENTS * CALLS >= 200
            assert outcomes["refused_429"] > 0 and outcomes["ok"] > 0  # the budgets did bite
            # Every request the provider saw is in the ledger; every billed call is one distinct call key.
            assert stats.requests == len(upstream)
            assert stats.calls == len(ok) == len(done_keys) == len({e["call_key"] for e in ok})
            # No lost usage: the ledger's tokens are the provider's.
            assert sum(e["input_tokens"] for e in ok) == stats.input_tokens
            assert sum(e["output_tokens"] for e in ok) == stats.output_tokens
            # No budget overrun, by the ledger and by the budgets' own books.
            per_session: dict[str, int] = defaultdict(int)
            for e in entries:
                per_session[e["session_id"]] += e["cost_nano"]
            assert max(per_session.values()) <= SESSION_LIMIT_USD * 1e9
            assert sum(per_session.values()) <= KEY_LIMIT_USD * 1e9
            for b in await store.budgets():
                assert b["spent_nano"] <= b["limit_nano"] and b["reserved_nano"] == 0
            counts = {"fake-openai": {k: v for k, v in stats.to_dict().items() if k != "served"}}
            counts["fake-openai"] = {}  # one fake serves both providers: compare the totals above instead
            assert await reconcile(store, gw.prices, counts) == []
        finally:
            await runner.cleanup()
