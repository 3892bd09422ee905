"""The gateway's ledger across nodes (issue 27): several `keepstate serve` nodes on one PostgreSQL database, each
with its metering gateway, in front of one deterministic fake provider. A call in flight carries its node's
incarnation; a retry through another node is answered from the store when the call was stored, is refused (409)
while the owning node lives, and takes the call over, once, when that node died before the provider answered; a
budget holds whichever nodes charge it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from keepstate.api.nodes import MEMBERSHIP
from keepstate.db.engine import Database
from keepstate.db.records import NodeRecord
from keepstate.db.repos import Nodes
from keepstate.db.repos.ledger import Attempt, BudgetRefused, CallInFlight, Ledger, Run
from keepstate.db.repos.ledger_claims import node_owner
from keepstate.gateway import Gateway, create_app
from keepstate.gateway.ledger import reconcile
from keepstate.testing import FakeProvider, Fault
from keepstate.testing.databases import database, db_url, postgres  # noqa: F401
from keepstate.testing.postgres import PostgresServer

from ..sandbox.conftest import Served, serving

LEASE = (1.0, 0.1, 0.4)  # TTL, renewal, fence margin: a node declared dead within seconds
HOST_KEY = "sk-host-secret"
PRICES = {"version": 1, "models": {"fake-*": {"input": 1.0, "output": 2.0}}}


@dataclass
class Node:
    served: Served
    gateway: Gateway
    url: str  # its gateway's
    runner: web.AppRunner
    alive: bool = True


@contextlib.asynccontextmanager
async def node(name: str, url: str, store: str, config: Path, key: str | None = None) -> AsyncIterator[Node]:
    """A `keepstate serve --node NAME` in this process, with its gateway served on 127.0.0.1 (the fake runtime's
    server registers runs but serves the gateway to no sandbox: here its handlers are served for the host)."""
    async with serving(node=name, db_url=url, store_url=store, lease=LEASE, gateway_config=config,
                       key=key) as served:
        gw = served.manager.gateway.gateway
        assert gw is not None
        app = create_app(gw.config, gw.ledger.db, gateway=gw)
        app.on_startup.clear()  # the server started this gateway, and closes it
        app.on_cleanup.clear()
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        n = Node(served, gw, f"http://127.0.0.1:{runner.addresses[0][1]}", runner)
        try:
            yield n
        finally:
            if n.alive:
                await runner.cleanup()


async def die(n: Node) -> None:
    """`kill -9` of a node, in this process: its lease is renewed no more (the reaper of another node declares it
    dead), its upstream requests stop where they are (their calls stay in flight under its incarnation) and its
    gateway's HTTP server goes away; it writes nothing more of them."""
    assert n.served.app is not None
    n.served.app[MEMBERSHIP].renew_once = _never  # type: ignore[method-assign]
    await n.gateway.close(grace_s=0)
    await n.runner.cleanup()
    n.alive = False


async def _never() -> None:
    """A renewal that never reaches the database."""


async def declared_dead(by: Node, name: str) -> None:
    nodes = Nodes(by.gateway.ledger.db)
    async with asyncio.timeout(30):
        while (found := await nodes.get(name)) is None or found.state != "dead":
            await asyncio.sleep(0.1)


def write_config(tmp_path: Path, fake: FakeProvider) -> Path:
    (tmp_path / "prices.json").write_text(json.dumps(PRICES))
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps({
        "providers": [{"name": "fake-openai", "kind": "openai", "base_url": fake.openai_base_url,
                       "api_key": HOST_KEY, "models": ["fake-*"], "stats_url": fake.stats_url}],
        "price_table": str(tmp_path / "prices.json"), "upstream_timeout_s": 60}))
    return path


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "fake-gpt", "messages": [{"role": "user", "content": text}], "stream": True,
            "stream_options": {"include_usage": True}, **extra}


async def post(n: Node, token: str, body: dict[str, Any], retry: int = 0) -> tuple[int, dict[str, str], bytes]:
    headers = {"authorization": f"Bearer {token}"}
    if retry:
        headers["x-stainless-retry-count"] = str(retry)
    async with aiohttp.ClientSession() as s, s.post(n.url + "/v1/chat/completions", json=body,
                                                     headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


async def retried(n: Node, token: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    """An SDK's retries of a call whose first attempt was lost: again while the answer is 409 (in flight
    elsewhere) or 503."""
    async with asyncio.timeout(30):
        for attempt in range(1, 1000):
            status, headers, data = await post(n, token, body, retry=attempt)
            if status not in (409, 503):
                return status, headers, data
            await asyncio.sleep(0.1)
    raise AssertionError("unreachable")


async def kill_mid_stream(n: Node, token: str, body: dict[str, Any]) -> bytes:
    """A client that reads the first bytes of a stream and goes away."""
    async with aiohttp.ClientSession() as s, s.post(n.url + "/v1/chat/completions", json=body,
                                                     headers={"authorization": f"Bearer {token}"}) as r:
        assert r.status == 200
        return await r.content.readany()


def provider_counts(fake: FakeProvider) -> dict[str, dict[str, Any]]:
    return {"fake-openai": {k: v for k, v in fake.stats().to_dict().items() if k != "served"}}


@pytest.mark.timeout(120)
async def test_a_call_stored_by_a_node_that_died_is_answered_from_the_store_through_another(
        postgres: PostgresServer, tmp_path: Path) -> None:  # noqa: F811
    url = postgres.createdb(f"gwcluster_{secrets.token_hex(6)}")
    store = f"file://{tmp_path / 'store'}"
    async with FakeProvider(api_key=HOST_KEY, chunk_s=0.1) as fake:
        config = write_config(tmp_path, fake)
        async with node("a", url, store, config) as a, node("b", url, store, config, key=a.served.key) as b:
            token = await a.gateway.register_run("sess", "sbx", "team", None)
            await a.gateway.set_budget("key", "team", 1.0)
            body = chat("a long story")
            first = await kill_mid_stream(a, token, body)  # the agent's connection drops mid-answer
            assert first.startswith(b"data: ")
            # A reads the answer on; a retry through B meanwhile finds it in flight under a live node: no re-issue.
            status, _, refused = await post(b, token, body, retry=1)
            assert status == 409, refused
            (call,) = await b.gateway.ledger.calls()
            assert (call.status, call.owner) == ("inflight", a.gateway.owner)
            assert call.owner == f"node/a/{a.served.app[MEMBERSHIP].incarnation}"  # type: ignore[index]
            await a.gateway.drain()  # A stored it: done, billed once
            await die(a)
            await declared_dead(b, "a")

            status, headers, answer = await post(b, token, body, retry=2)
            assert status == 200 and headers["x-keepstate-source"] == "store"
            (call,) = await b.gateway.ledger.calls()
            assert call.status == "done" and answer == call.response  # what the provider sent, byte for byte
            assert answer.startswith(first) and answer.rstrip().endswith(b"data: [DONE]")
            assert (fake.stats().requests, fake.stats().calls) == (1, 1)
            entries = await b.gateway.ledger.entries()
            assert [(e["kind"], e["outcome"], e["cost_nano"] > 0) for e in entries] == [
                ("upstream", "ok", True), ("store", "ok", False)]
            budget = await b.gateway.ledger.budget("key", "team")
            assert budget is not None and (budget["spent_nano"], budget["reserved_nano"]) == (
                entries[0]["cost_nano"], 0)
            assert await reconcile(b.gateway.ledger, b.gateway.prices, provider_counts(fake)) == []


@pytest.mark.timeout(120)
async def test_a_call_whose_node_died_before_the_answer_is_reissued_once_through_two_others(
        postgres: PostgresServer, tmp_path: Path) -> None:  # noqa: F811
    url = postgres.createdb(f"gwcluster_{secrets.token_hex(6)}")
    store = f"file://{tmp_path / 'store'}"
    async with FakeProvider(api_key=HOST_KEY) as fake:
        config = write_config(tmp_path, fake)
        async with node("a", url, store, config) as a, node("b", url, store, config, key=a.served.key) as b, \
                node("c", url, store, config, key=a.served.key) as c:
            token = await a.gateway.register_run("sess", "sbx", "team", None)
            await a.gateway.set_budget("key", "team", 1.0)
            body = chat("the answer that A never got")
            fake.inject(Fault(hang=True))  # the provider takes A's request and answers nothing
            first = asyncio.create_task(post(a, token, body))
            async with asyncio.timeout(10):
                while fake.stats().requests < 1:
                    await asyncio.sleep(0.01)
            (call,) = await c.gateway.ledger.calls()
            assert (call.status, call.owner) == ("inflight", a.gateway.owner)
            assert (await post(b, token, body, retry=1))[0] == 409  # A lives: B takes nothing over

            await die(a)
            lost = await asyncio.gather(first, return_exceptions=True)
            assert isinstance(lost[0], aiohttp.ClientError) or lost[0][0] == 503  # type: ignore[index]
            await declared_dead(b, "a")
            fake.first_token_s = 0.5  # B's or C's re-issue is in flight while the other's retry arrives
            (sb, hb, ab), (sc, hc, ac) = await asyncio.gather(retried(b, token, body), retried(c, token, body))

            assert sb == sc == 200 and ab == ac and ab.rstrip().endswith(b"data: [DONE]")
            assert sorted([hb["x-keepstate-source"], hc["x-keepstate-source"]]) == ["store", "upstream"]
            assert (fake.stats().requests, fake.stats().calls) == (2, 1)  # A's lost request, and one re-issue
            (call,) = await b.gateway.ledger.calls()
            assert (call.status, call.owner, call.response) == ("done", None, ab)
            entries = await b.gateway.ledger.entries()
            assert sorted((e["kind"], e["outcome"], e["cost_nano"] > 0) for e in entries) == [
                ("store", "ok", False), ("upstream", "interrupted", False), ("upstream", "ok", True)]
            charged = sum(e["cost_nano"] for e in entries)
            budget = await b.gateway.ledger.budget("key", "team")
            # Billed once; A's lost request is charged to the budget at its worst case (the provider may have
            # billed it), and nothing stays reserved.
            assert budget is not None and budget["reserved_nano"] == 0 and budget["spent_nano"] > charged
            assert await reconcile(b.gateway.ledger, b.gateway.prices, provider_counts(fake)) == []


@pytest.mark.timeout(120)
async def test_a_budget_holds_across_nodes(postgres: PostgresServer, tmp_path: Path) -> None:  # noqa: F811
    url = postgres.createdb(f"gwcluster_{secrets.token_hex(6)}")
    store = f"file://{tmp_path / 'store'}"
    async with FakeProvider(api_key=HOST_KEY, first_token_s=1.0) as fake:
        config = write_config(tmp_path, fake)
        async with node("a", url, store, config) as a, node("b", url, store, config, key=a.served.key) as b:
            tokens = {a.url: await a.gateway.register_run("s1", "sbx1", "team", None),
                      b.url: await b.gateway.register_run("s2", "sbx2", "team", None)}
            bodies = [chat(f"call number {i:02d}", max_tokens=32) for i in range(20)]
            raw = len(json.dumps(bodies[0]).encode())  # aiohttp's own JSON: every body has this length
            worst = (raw * 1 + 32 * 2) * 1000 + 1  # nano-USD: input at most a token a byte, output its max_tokens
            await a.gateway.set_budget("key", "team", 5.5 * worst / 1e9)  # room for five calls' worst cases
            budget = await a.gateway.ledger.budget("key", "team")
            assert budget is not None and 5 * worst <= budget["limit_nano"] < 6 * worst

            through = [(a, b)[i % 2] for i in range(len(bodies))]  # every other call through each node
            results = await asyncio.gather(*(post(n, tokens[n.url], body)
                                             for n, body in zip(through, bodies, strict=True)))
            statuses = sorted(r[0] for r in results)
            # Every call began while the first ones were still waiting on the provider: five fit, wherever.
            assert statuses == [200] * 5 + [429] * 15
            budget = await a.gateway.ledger.budget("key", "team")
            entries = await a.gateway.ledger.entries()
            assert budget is not None and budget["reserved_nano"] == 0
            assert budget["spent_nano"] == sum(e["cost_nano"] for e in entries) <= budget["limit_nano"]
            assert fake.stats().calls == len([e for e in entries if e["kind"] == "upstream"]) == 5
            assert await reconcile(a.gateway.ledger, a.gateway.prices, provider_counts(fake)) == []


def attempt(key: str) -> Attempt:
    run = Run(run_id="run_1", session_id="sess", sandbox_id="sbx", api_key_id="team", checkpoint_id=None,
              mode="diverge", parent_session_id=None)
    return Attempt(call_key=key, run=run, provider="p", model="fake-gpt", endpoint="chat", started_at=0.0)


def a_node(name: str) -> NodeRecord:
    return NodeRecord(node_id=name, address=f"http://{name}:3000", cpus=2.0, memory_mb=4096, max_sandboxes=10,
                      runsc_release="", cpu_features=(), templates=())


async def test_a_call_is_taken_over_only_from_a_gone_incarnation_and_once(database: Database) -> None:  # noqa: F811
    """The ledger's side, on SQLite and PostgreSQL: a call in flight under a node's incarnation is claimed again
    only once that incarnation lost its `nodes` row, by one conditional claim of the two that race for it; the lost
    attempt is interrupted (billed once, its reservation charged), and its late finish writes nothing."""
    nodes = Nodes(database)
    a = await nodes.join(a_node("a"), ttl_s=60)
    b, c = await nodes.join(a_node("b"), ttl_s=60), await nodes.join(a_node("c"), ttl_s=60)
    other = await Database.open(database.url)  # another node's connection
    try:
        on_a = Ledger(database, node_owner("a", a.incarnation))
        on_b = Ledger(database, node_owner("b", b.incarnation))
        on_c = Ledger(other, node_owner("c", c.incarnation))
        await on_a.create_run(attempt("k").run, "h")
        await on_a.set_budget("key", "team", 1000)
        await on_a.begin_upstream(attempt("k"), True, "h1", None, [("key", "team")], 300)
        with pytest.raises(CallInFlight):  # a lives: nobody takes its call
            await on_b.begin_upstream(attempt("k"), True, "h1", None, [("key", "team")], 300, alive=lambda o: True)
        assert await on_b.recover(lambda o: True) == []
        with pytest.raises(CallInFlight):  # without `alive`, a call in flight is never taken over
            await on_b.begin_upstream(attempt("k"), True, "h1", None, [("key", "team")], 300)

        again = await nodes.join(a_node("a"), ttl_s=60)  # a restarted: its earlier incarnation is gone for good
        assert again.incarnation == a.incarnation + 1
        outcomes = await asyncio.gather(
            on_b.begin_upstream(attempt("k"), True, "h1", None, [("key", "team")], 300, alive=lambda o: True),
            on_c.begin_upstream(attempt("k"), True, "h1", None, [("key", "team")], 300, alive=lambda o: True),
            return_exceptions=True)
        assert sorted(type(o).__name__ for o in outcomes) == ["CallInFlight", "str"]
        assert node_owner("a", a.incarnation) in outcomes
        winner = on_b if outcomes[0] == node_owner("a", a.incarnation) else on_c
        call = await on_b.call("k")
        assert call is not None and (call.status, call.owner) == ("inflight", winner.owner)
        # The gone incarnation's late finish (it was only cut off) is refused: billed by the winner alone.
        assert await on_a.finish_upstream(attempt("k"), ok=True, outcome="ok", http_status=200, content_type=None,
                                          response=b"late", usage=None, request_id=None, cost_nano=7,
                                          priced=True) is None
        assert await winner.finish_upstream(attempt("k"), ok=True, outcome="ok", http_status=200, content_type=None,
                                            response=b"won", usage=None, request_id=None, cost_nano=5,
                                            priced=True) is not None
        entries = await on_b.entries()
        assert [(e["kind"], e["outcome"], e["cost_nano"]) for e in entries] == [
            ("upstream", "interrupted", 0), ("upstream", "ok", 5)]
        budget = await on_b.budget("key", "team")
        assert budget is not None and (budget["spent_nano"], budget["reserved_nano"]) == (300 + 5, 0)
        assert await on_b.recover(lambda o: True) == []
    finally:
        await other.close()


async def test_recovery_judges_node_owners_by_the_nodes_table(database: Database) -> None:  # noqa: F811
    nodes = Nodes(database)
    a, b = await nodes.join(a_node("a"), ttl_s=60), await nodes.join(a_node("b"), ttl_s=60)
    on_a, on_b = Ledger(database, node_owner("a", a.incarnation)), Ledger(database, node_owner("b", b.incarnation))
    await on_a.create_run(attempt("k1").run, "h")
    await on_a.begin_upstream(attempt("k1"), False, "h1", None, [], 0)
    await on_b.begin_upstream(attempt("k2"), False, "h2", None, [], 0)
    everyone_alive = lambda owner: True  # noqa: E731  # process owners: none here
    assert await on_b.recover(everyone_alive) == []
    assert await nodes.leave("a", a.incarnation)  # a stopped (its calls had not finished)
    assert await on_b.recover(everyone_alive) == ["k1"]
    assert [(c.call_key, c.status) for c in await on_b.calls()] == [("k1", "interrupted"), ("k2", "inflight")]


async def test_a_takeover_refused_by_the_budget_still_settles_the_lost_attempt(database: Database) -> None:  # noqa: F811
    nodes = Nodes(database)
    a, b = await nodes.join(a_node("a"), ttl_s=60), await nodes.join(a_node("b"), ttl_s=60)
    on_a, on_b = Ledger(database, node_owner("a", a.incarnation)), Ledger(database, node_owner("b", b.incarnation))
    await on_a.create_run(attempt("k").run, "h")
    await on_a.set_budget("key", "team", 500)
    await on_a.begin_upstream(attempt("k"), False, "h1", None, [("key", "team")], 300)
    assert await nodes.leave("a", a.incarnation)
    with pytest.raises(BudgetRefused):  # a's lost request is charged (300), and b's worst case no longer fits
        await on_b.begin_upstream(attempt("k"), False, "h1", None, [("key", "team")], 300, alive=lambda o: True)
    call = await on_b.call("k")
    assert call is not None and (call.status, call.owner) == ("interrupted", None)
    budget = await on_b.budget("key", "team")
    assert budget is not None and (budget["spent_nano"], budget["reserved_nano"]) == (300, 0)
    assert [(e["kind"], e["outcome"]) for e in await on_b.entries()] == [("upstream", "interrupted")]
