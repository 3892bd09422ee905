"""The nodes repository on SQLite and PostgreSQL: joins make incarnations, only the holding incarnation renews,
leases are judged by the database's clock, and the reaper declares dead only what expired past its grace, never most
of the cluster at once (a database that was away makes every lease look expired)."""

from __future__ import annotations

import asyncio

import pytest

from keepstate.db.engine import Database
from keepstate.db.records import NodeRecord
from keepstate.db.repos import Nodes


def node(name: str, **kw: object) -> NodeRecord:
    return NodeRecord(node_id=name, address=f"http://127.0.0.1:{3000 + ord(name[0])}", cpus=2.0, memory_mb=4096,
                      max_sandboxes=50, runsc_release="20240729", cpu_features=("avx2", "sse4_2"),
                      templates=("base",), **kw)  # type: ignore[arg-type]


async def test_joins_make_incarnations_and_only_the_holder_renews(database: Database) -> None:
    nodes = Nodes(database)
    first = await nodes.join(node("a"), ttl_s=10)
    now = await nodes.now()
    assert first.incarnation == 1 and first.state == "alive" and first.cpu_features == ("avx2", "sse4_2")
    assert now - 1 < first.joined_at <= now and abs(first.lease_expires_at - (first.joined_at + 10)) < 0.01
    renewed = await nodes.renew("a", 1, ttl_s=30, metrics='{"sandboxes": 3}')
    assert renewed is not None and renewed[0] > first.lease_expires_at + 15 and renewed[1] == "alive"
    again = await nodes.join(node("a"), ttl_s=10)  # the same node started anew
    assert again.incarnation == 2
    assert await nodes.renew("a", 1, ttl_s=10) is None  # the old incarnation's lease is gone
    assert await nodes.renew("a", 2, ttl_s=10) is not None
    assert await nodes.leave("a", 2) and (await nodes.get("a")).state == "left"  # type: ignore[union-attr]
    assert await nodes.renew("a", 2, ttl_s=10) is None  # left: nothing to renew
    assert not await nodes.leave("a", 2)


async def test_drain_and_remove(database: Database) -> None:
    nodes = Nodes(database)
    a = await nodes.join(node("a"), ttl_s=10)
    await nodes.join(node("b"), ttl_s=10)
    assert await nodes.drain("a") and not await nodes.drain("a") and not await nodes.drain("zz")
    assert [(n.node_id, n.state) for n in await nodes.list()] == [("a", "draining"), ("b", "alive")]
    assert await nodes.renew("a", a.incarnation, ttl_s=10) == (pytest.approx(await nodes.now() + 10, abs=0.5),
                                                                "draining")  # it keeps its lease, and hears it
    assert await nodes.remove("a") and not await nodes.remove("a")
    assert await nodes.renew("a", a.incarnation, ttl_s=10) is None
    assert [n.node_id for n in await nodes.list()] == ["b"]
    assert (await nodes.join(node("a"), ttl_s=10)).incarnation == a.incarnation + 1  # never an old one again


async def test_the_reaper_declares_dead_what_expired_past_its_grace(database: Database) -> None:
    nodes = Nodes(database)
    for name in "abcd":
        await nodes.join(node(name), ttl_s=60)
    short = await nodes.join(node("e"), ttl_s=0.05)  # its lease runs out at once
    assert await nodes.expire(grace_s=0.3) == []  # expired, but not past the grace yet
    await asyncio.sleep(0.45)
    assert await nodes.expire(grace_s=0.3, spare="e") == []  # the caller's own node is never declared here
    [dead] = await nodes.expire(grace_s=0.3)
    assert (dead.node_id, dead.state, dead.incarnation) == ("e", "dead", short.incarnation)
    assert await nodes.renew("e", short.incarnation, ttl_s=10) is None  # the dead incarnation cannot come back
    assert (await nodes.join(node("e"), ttl_s=10)).incarnation == short.incarnation + 1  # it rejoins anew
    assert await nodes.expire(grace_s=0.3) == []  # idempotent


async def test_the_reaper_declares_nobody_dead_when_most_leases_look_expired(database: Database) -> None:
    nodes = Nodes(database)
    for name in "abc":
        await nodes.join(node(name), ttl_s=0.05)
    await nodes.join(node("d"), ttl_s=60)
    await asyncio.sleep(0.2)
    assert await nodes.expire(grace_s=0.1, max_dead_fraction=0.5) == []  # 3 of 4: the database's outage, not deaths
    assert {n.state for n in await nodes.list()} == {"alive"}
    assert len(await nodes.expire(grace_s=0.1, max_dead_fraction=0.8)) == 3


async def test_concurrent_joins_of_one_new_name_each_get_an_incarnation(database: Database) -> None:
    """Two servers started with the same --node at once: neither fails on the row's creation; each gets its own
    incarnation, and only the last one holds the row (the others' renewals are refused)."""
    nodes = Nodes(database)
    joined = await asyncio.gather(*(nodes.join(node("twin"), ttl_s=10) for _ in range(5)))
    assert sorted(j.incarnation for j in joined) == [1, 2, 3, 4, 5]
    holder = max(j.incarnation for j in joined)
    for j in joined:
        renewed = await nodes.renew("twin", j.incarnation, ttl_s=10)
        assert (renewed is not None) == (j.incarnation == holder)
