"""Paused retention across a cluster (two servers on one PostgreSQL database and one store): the store is collected
by one node at a time, under the `store-gc` lease, which a long collection keeps by renewing it past its TTL; each
node deletes its own paused sandboxes, never a live node's, and takes over and deletes those of a node that is
gone."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
from pathlib import Path

import sqlalchemy as sa

from keepstate.api.relay import RELAYED
from keepstate.db.repos import Leases, Nodes
from keepstate.db.schema import sandboxes as table
from keepstate.sandbox.retention import GC_LEASE, Retention
from keepstate.store.gc import GcReport
from keepstate.testing.databases import postgres  # noqa: F401
from keepstate.testing.postgres import PostgresServer

from ..sandbox.conftest import Served, serving
from ..sandbox.test_lifecycle import events
from ..sandbox.test_retention import retention_of

LEASE = (1.0, 0.1, 0.4)  # the nodes' membership: TTL, renewal, fence margin


class Collections:
    """A stand-in for the store's gc on every node: counts the collections running at once, and runs each until the
    test opens the gate."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = self.most = self.done = 0
        self.started = threading.Event()
        self.gate = threading.Event()

    def gc(self) -> GcReport:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.started.set()
        try:
            assert self.gate.wait(30), "the test never let the collection finish"
        finally:
            with self.lock:
                self.running -= 1
                self.done += 1
        return GcReport()


def stand_in(*nodes: Retention) -> Collections:
    collections = Collections()
    for r in nodes:
        r.collect_store = collections.gc
        r.lease_ttl = 0.3  # renewed every 0.1 s while a collection runs
    return collections


async def paused_on(s: Served, age: float) -> str:
    """A sandbox paused on `s` itself (its create marked relayed: not placed on another node)."""
    async with s.http.post(f"{s.url}/sandboxes", json={"templateID": "base", "timeout": 300},
                           headers={**s.headers, RELAYED: "test"}) as r:
        made = await r.json()
        assert r.status == 201, made
    sid = made["sandboxID"]
    assert sid in s.manager.records
    assert (await s.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204
    async with s.manager.db.transaction() as conn:  # as if paused `age` seconds ago
        await conn.execute(sa.update(table).where(table.c.sandbox_id == sid)
                           .values(paused_at=table.c.paused_at - age))
    return sid


async def test_two_nodes_never_collect_the_store_at_once(postgres: PostgresServer,  # noqa: F811
                                                         tmp_path: Path) -> None:
    url = postgres.createdb(f"retention_{secrets.token_hex(6)}")
    options = {"db_url": url, "store_url": f"file://{tmp_path / 'store'}", "lease": LEASE,
               "paused_retention": 3600, "retention_every": 3600}  # rounds run when the test says
    async with serving(node="a", **options) as a, serving(node="b", key=a.key, **options) as b:
        ra, rb = retention_of(a), retention_of(b)
        collections = stand_in(ra, rb)
        leases, clock = Leases(a.manager.db), Nodes(a.manager.db)

        # A collection that runs past its lease's TTL keeps the lease (renewed): the other node waits its turn.
        on_a = asyncio.ensure_future(ra.collect())
        assert await asyncio.to_thread(collections.started.wait, 10)
        first = await leases.get(GC_LEASE)
        assert first is not None and first.holder == ra.holder
        while await clock.now() <= first.expires_at + 0.3:  # by the database's clock, well past the first TTL
            await asyncio.sleep(0.05)
        assert await rb.collect() is None  # a still holds it
        held = await leases.get(GC_LEASE)
        assert held is not None and held.holder == ra.holder and held.token == first.token
        assert held.expires_at > first.expires_at
        collections.gate.set()
        assert await on_a is not None
        assert await rb.collect() is not None  # released: b's turn
        assert (await leases.get(GC_LEASE)).token == first.token + 1  # type: ignore[union-attr]

        # Both at once, again and again: never two collections at the same time.
        for _ in range(10):
            await asyncio.gather(ra.collect(), rb.collect())
        assert collections.most == 1 and collections.done >= 12


async def test_each_node_deletes_its_own_and_a_gone_nodes_paused_sandboxes(postgres: PostgresServer,  # noqa: F811
                                                                           tmp_path: Path) -> None:
    url = postgres.createdb(f"retention_{secrets.token_hex(6)}")
    options = {"db_url": url, "store_url": f"file://{tmp_path / 'store'}", "lease": LEASE,
               "paused_retention": 3600, "retention_every": 3600}
    async with contextlib.AsyncExitStack() as on_a:
        a = await on_a.enter_async_context(serving(node="a", **options))
        async with serving(node="b", key=a.key, **options) as b:
            ra, rb = retention_of(a), retention_of(b)
            collections = stand_in(ra, rb)
            collections.gate.set()
            mine = await paused_on(a, 7200)
            assert await rb.round() == []  # a is live: its sandbox is a's to delete
            assert await ra.round() == [mine]
            assert (await b.call("GET", f"/sandboxes/{mine}"))[0] == 404
            assert collections.done == 1  # a unpublished its checkpoint, and collected

            left_behind = await paused_on(a, 7200)
            await on_a.aclose()  # a stops cleanly (the sandbox stays paused, its row a's) and leaves
            assert await rb.round() == [left_behind]  # b takes it over, then deletes it
            assert (await b.call("GET", f"/sandboxes/{left_behind}"))[0] == 404
            kinds = [(e["kind"], e["data"]) for e in await events(b, left_behind)]
            assert kinds[-2][0] == "sandbox.node.moved" and kinds[-1] == ("sandbox.kill", {"reason": "retention"})
            assert collections.done == 2
