"""Idempotency keys on SQLite and PostgreSQL (docs/design/idempotency.md): the first begin records, later ones see
it; an expired key is replaced; only a gone owner's in-progress key can be taken over, once; finish and abandon are
the owner's alone; racing begins on two databases record one."""

from __future__ import annotations

import asyncio
import dataclasses

from keepstate.db.engine import Database
from keepstate.db.records import IdempotencyRecord, NodeRecord
from keepstate.db.repos import Nodes
from keepstate.db.repos.idempotency import Idempotency
from keepstate.db.repos.ledger_claims import node_owner


def key(owner: str, sandbox_id: str = "sb-1", digest: str = "d1") -> IdempotencyRecord:
    return IdempotencyRecord(api_key_id="k1", key="abc", digest=digest, sandbox_id=sandbox_id, state="in_progress",
                             owner=owner)


async def test_begin_records_once_and_the_owner_finishes_or_abandons(database: Database) -> None:
    keys = Idempotency(database)
    first = await keys.begin(key("me"), ttl_s=60)
    assert (first.owner, first.sandbox_id, first.state) == ("me", "sb-1", "in_progress")
    assert first.expires_at - first.created_at == 60
    second = await keys.begin(key("other", "sb-2", "d2"), ttl_s=60)
    assert (second.owner, second.sandbox_id, second.digest) == ("me", "sb-1", "d1")  # the first one stands
    assert not await keys.finish("k1", "abc", "other", "{}")  # not its owner
    assert not await keys.abandon("k1", "abc", "other")
    assert await keys.finish("k1", "abc", "me", '{"sandboxID": "sb-1"}')
    done = await keys.get("k1", "abc")
    assert done is not None and (done.state, done.response) == ("done", '{"sandboxID": "sb-1"}')
    assert not await keys.abandon("k1", "abc", "me")  # done is final
    other_scope = await keys.begin(dataclasses.replace(key("me", "sb-9"), api_key_id="k2"), ttl_s=60)
    assert other_scope.sandbox_id == "sb-9"  # a key is its API key's own


async def test_an_abandoned_or_expired_key_is_free_again(database: Database) -> None:
    keys = Idempotency(database)
    await keys.begin(key("me"), ttl_s=60)
    assert await keys.abandon("k1", "abc", "me")
    assert await keys.get("k1", "abc") is None
    await keys.begin(key("me", "sb-2"), ttl_s=-1)  # expired at once
    again = await keys.begin(key("you", "sb-3"), ttl_s=60)
    assert (again.owner, again.sandbox_id) == ("you", "sb-3")


async def test_only_a_gone_owners_key_is_taken_over_and_only_once(database: Database) -> None:
    nodes, keys = Nodes(database), Idempotency(database)
    a = await nodes.join(NodeRecord(node_id="a", address="http://a", cpus=1, memory_mb=1, max_sandboxes=1,
                                    runsc_release="r"), ttl_s=60)
    owner = node_owner("a", a.incarnation)
    await keys.begin(key(owner), ttl_s=60)
    assert not await keys.owner_gone(owner)
    await nodes.join(a, ttl_s=60)  # a restarted: a new incarnation, the old one gone for good
    assert await keys.owner_gone(owner)
    taken = await asyncio.gather(*(keys.take_over("k1", "abc", owner, f"taker-{i}") for i in range(5)))
    assert taken.count(True) == 1
    winner = f"taker-{taken.index(True)}"
    assert not await keys.finish("k1", "abc", owner, "{}")  # the gone owner's late finish writes nothing
    assert await keys.finish("k1", "abc", winner, "{}")
