"""Membership on a real database: the lease is renewed, the node fences itself on its monotonic clock before the
database would call it dead when it cannot renew, and lifts the fence when it can again; a node declared dead (or
removed) is told, and rejoins as a new incarnation; another node's expired lease is reaped only once this node has
been connected for two lease lengths."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from keepstate.cluster.membership import Membership
from keepstate.db.engine import Database
from keepstate.db.errors import DatabaseUnavailable
from keepstate.db.records import NodeRecord
from keepstate.db.repos import Nodes
from keepstate.testing.databases import database, db_url, postgres  # noqa: F401

TTL, RENEW, MARGIN = 1.0, 0.1, 0.4


class FlakyNodes(Nodes):
    """Nodes whose renewals fail, as a database that went away, while `down` is set."""

    down = False
    renewals = 0

    async def renew(self, *args: object, **kw: object) -> tuple[float, str] | None:
        self.renewals += 1
        if self.down:
            raise DatabaseUnavailable("the database went away (test)")
        return await super().renew(*args, **kw)  # type: ignore[arg-type]


def me(name: str = "a") -> NodeRecord:
    return NodeRecord(node_id=name, address="http://127.0.0.1:3000", cpus=2, memory_mb=4096, max_sandboxes=10,
                      runsc_release="20240729")


@pytest.fixture
async def nodes(database: Database) -> FlakyNodes:  # noqa: F811
    return FlakyNodes(database)


@contextlib.asynccontextmanager
async def running(m: Membership) -> AsyncIterator[None]:
    task = asyncio.get_running_loop().create_task(m.run())
    try:
        yield
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_node_renews_fences_when_it_cannot_and_serves_again_when_it_can(nodes: FlakyNodes) -> None:
    events: list[str] = []
    fenced_at: list[tuple[float, float]] = []  # (wall clock, monotonic) at the moment it fenced itself
    ttl, margin = 3.0, 1.5  # a margin wide enough for a loaded host to wake the loop in time

    def on_fence(why: str) -> None:
        fenced_at.append((time.time(), time.monotonic()))
        events.append(why)

    m = Membership(nodes, me(), ttl_s=ttl, renew_s=RENEW, fence_margin_s=margin, on_fence=on_fence,
                   on_unfence=lambda: events.append("unfenced"))
    await m.join()
    async with running(m):
        while nodes.renewals < 2:
            await asyncio.sleep(RENEW)
        assert m.fenced is None
        nodes.down = True
        while m.fenced is None:
            await asyncio.sleep(0.01)
        last_ok = m.last_ok
        lease = (await nodes.get("a")).lease_expires_at  # type: ignore[union-attr]  # what the database holds
        # Fenced by its own clock, never before its deadline, and before the database's lease ran out.
        wall, mono = fenced_at[0]
        assert mono >= last_ok + ttl - margin and wall < lease and "could not be renewed" in m.fenced
        nodes.down = False
        while m.fenced is not None:
            await asyncio.sleep(0.01)
    assert events[-1] == "unfenced" and len(events) == 2
    assert (await nodes.get("a")).incarnation == 1  # type: ignore[union-attr]  # the same incarnation came back


async def test_a_node_declared_dead_is_told_and_rejoins_as_a_new_incarnation(nodes: FlakyNodes) -> None:
    lost: list[int] = []
    m = Membership(nodes, me(), ttl_s=TTL, renew_s=RENEW, fence_margin_s=MARGIN)

    async def on_lost() -> None:
        lost.append(m.incarnation)
        assert m.fenced is not None  # it serves nothing while it destroys what is no longer its own

    m.on_lost = on_lost
    await m.join()
    assert await nodes.remove("a")  # an operator removes it (or a reaper declared it dead)
    await m.renew_once()
    assert lost == [1] and m.incarnation == 2 and m.fenced is None
    assert (await nodes.get("a")).state == "alive"  # type: ignore[union-attr]


async def test_without_fencing_a_node_that_cannot_renew_goes_on_serving(nodes: FlakyNodes) -> None:
    m = Membership(nodes, me(), fencing=False, ttl_s=TTL, renew_s=RENEW, fence_margin_s=MARGIN)
    await m.join()
    nodes.down = True
    async with running(m):
        await asyncio.sleep(TTL + 0.2)
        assert m.fenced is None


async def test_expired_nodes_are_reaped_only_after_two_lease_lengths_connected(nodes: FlakyNodes) -> None:
    dead: list[str] = []

    async def on_dead(found: list[NodeRecord]) -> None:
        dead.extend(n.node_id for n in found)

    other = await nodes.join(me("b"), ttl_s=0.05)  # a node that stops renewing at once
    await nodes.join(me("c"), ttl_s=60)
    await nodes.join(me("d"), ttl_s=60)
    m = Membership(nodes, me(), ttl_s=TTL, renew_s=RENEW, fence_margin_s=MARGIN, on_dead=on_dead)
    await m.join()
    started = time.monotonic()
    async with running(m):
        while not dead:
            await asyncio.sleep(0.02)
        waited = time.monotonic() - started
    assert dead == ["b"] and waited >= 2 * TTL - 0.05  # not before this node had been connected 2 TTL
    assert (await nodes.get("b")).state == "dead"  # type: ignore[union-attr]
    assert await nodes.renew("b", other.incarnation, ttl_s=1) is None
