"""`sandboxes.paused_at` on SQLite and PostgreSQL: the repository stamps it with the database's clock when a row
becomes paused, keeps it while the row is paused, resuming or being killed (a failed resume does not restart its
retention), clears it when the row runs again; `paused_longer_than` finds this node's and gone nodes' rows paused
longer than a retention, and stamps rows paused before the column existed."""

from __future__ import annotations

import dataclasses

import pytest
import sqlalchemy as sa

from keepstate.db.engine import Database
from keepstate.db.records import NodeRecord, SandboxRecord
from keepstate.db.repos import Nodes, Sandboxes
from keepstate.db.schema import sandboxes as table


def sandbox(sandbox_id: str, state: str = "running", **changes: object) -> SandboxRecord:
    rec = SandboxRecord(sandbox_id=sandbox_id, state=state, template_id="base", template_digest="sha256:d",
                        runtime_name="", slot=-1, address="", access_token="tok", started_at=100.0, end_at=400.0,
                        cpu=1.0, memory_mb=512, api_key_id=None, doc="{}", node_id="local")
    return dataclasses.replace(rec, **changes)  # type: ignore[arg-type]


async def age(db: Database, sandbox_id: str, seconds: float) -> None:
    """Move the sandbox's pause `seconds` into the past (the database's clock cannot be moved)."""
    async with db.transaction() as conn:
        await conn.execute(sa.update(table).where(table.c.sandbox_id == sandbox_id)
                           .values(paused_at=table.c.paused_at - seconds))


async def paused_at(sandboxes: Sandboxes, sandbox_id: str) -> float | None:
    rec = await sandboxes.get(sandbox_id)
    assert rec is not None
    return rec.paused_at


async def test_paused_at_follows_the_state(database: Database) -> None:
    sandboxes, nodes = Sandboxes(database), Nodes(database)
    await sandboxes.insert(sandbox("a"))
    assert await paused_at(sandboxes, "a") is None
    v = await sandboxes.transition("a", 0, 0, state="pausing")
    assert await paused_at(sandboxes, "a") is None
    v = await sandboxes.transition("a", v, 0, state="paused")
    stamped = await paused_at(sandboxes, "a")
    assert stamped is not None and stamped == pytest.approx(await nodes.now(), abs=5)
    v = await sandboxes.transition("a", v, 0, state="paused", doc='{"x": 1}')  # a standby released: still paused
    v = await sandboxes.transition("a", v, 0, state="resuming")
    v = await sandboxes.transition("a", v, 0, state="paused")  # the resume failed: paused since as before
    v = await sandboxes.transition("a", v, 0, end_at=1.0)  # no state written: nothing changes
    assert await paused_at(sandboxes, "a") == stamped
    v = await sandboxes.transition("a", v, 0, state="resuming")
    v = await sandboxes.transition("a", v, 0, state="running")
    assert await paused_at(sandboxes, "a") is None
    await sandboxes.insert(sandbox("b", "paused"))  # born paused (loaded from the store)
    assert await paused_at(sandboxes, "b") is not None
    assert await sandboxes.get("b") == sandbox("b", "paused")  # records compare without it


async def test_paused_longer_than_finds_own_and_gone_nodes_rows(database: Database) -> None:
    sandboxes, nodes = Sandboxes(database), Nodes(database)
    me = NodeRecord(node_id="a", address="http://a", cpus=1, memory_mb=1, max_sandboxes=1, runsc_release="r")
    await nodes.join(me, ttl_s=60)
    b = await nodes.join(dataclasses.replace(me, node_id="b", address="http://b"), ttl_s=60)
    for sid, node in (("old", "a"), ("new", "a"), ("theirs", "b"), ("running", "a")):
        await sandboxes.insert(sandbox(sid, "running" if sid == "running" else "paused", node_id=node))
    await age(database, "old", 7200)
    await age(database, "theirs", 7200)
    assert await sandboxes.paused_longer_than(3600, "a") == ["old"]  # b is live: its sandbox is b's to delete
    assert await sandboxes.paused_longer_than(3600, "b") == ["theirs"]
    assert await sandboxes.paused_longer_than(3600, "a", "new") == []
    assert await nodes.leave("b", b.incarnation)
    assert sorted(await sandboxes.paused_longer_than(3600, "a")) == ["old", "theirs"]  # b is gone
    assert await sandboxes.paused_longer_than(3600, "a", "old") == ["old"]
    moved = await sandboxes.take_over("theirs", "a")  # taken over: still paused since it was there
    assert moved is not None and await sandboxes.paused_longer_than(3600, "a", "theirs") == ["theirs"]


async def test_rows_paused_before_the_column_count_from_the_first_look(database: Database) -> None:
    sandboxes = Sandboxes(database)
    await sandboxes.insert(sandbox("p", "paused"))
    async with database.transaction() as conn:  # as revision 0003 leaves a row paused before it, or a legacy import
        await conn.execute(sa.update(table).where(table.c.sandbox_id == "p").values(paused_at=None))
    assert await paused_at(sandboxes, "p") is None
    assert await sandboxes.paused_longer_than(60, "local") == []  # stamped now: paused for no time yet
    assert await paused_at(sandboxes, "p") is not None
    before = await sandboxes.get("p")
    await age(database, "p", 100)
    assert await sandboxes.paused_longer_than(50, "local") == ["p"]
    after = await sandboxes.get("p")
    assert after is not None and before is not None and after.version == before.version  # the owner's writes hold
