"""Snapshots on SQLite and PostgreSQL: a name resolves to one snapshot or none; delete takes the names with it."""

from __future__ import annotations

import pytest

from keepstate.db.engine import Database
from keepstate.db.records import SnapshotRecord
from keepstate.db.repos import Snapshots
from keepstate.errors import Conflict

from .race import HeldCommit, race


def snapshot(snapshot_id: str, *names: str, created_at: float = 1.0) -> SnapshotRecord:
    return SnapshotRecord(snapshot_id=snapshot_id, checkpoint_id=f"ck-{snapshot_id}", sandbox_id="sb1",
                          template_id="base", created_at=created_at, names=names)


async def test_put_get_by_name_list_delete(database: Database) -> None:
    snapshots = Snapshots(database)
    a = snapshot("a", "my-env", "alias", created_at=2.0)
    b = snapshot("b", created_at=1.0)  # no name: found by ID only
    await snapshots.put(a)
    await snapshots.put(b)
    assert await snapshots.get("a") == snapshot("a", "alias", "my-env", created_at=2.0)  # names come back sorted
    assert await snapshots.get("b") == b and await snapshots.get("nope") is None
    assert await snapshots.by_name("my-env") == await snapshots.by_name("alias") == await snapshots.get("a")
    assert await snapshots.by_name("nope") is None and await snapshots.by_name("a") is None
    assert [s.snapshot_id for s in await snapshots.list()] == ["b", "a"]
    assert (await snapshots.list())[1].names == ("alias", "my-env")
    assert await snapshots.delete("a") is True and await snapshots.delete("a") is False
    assert await snapshots.by_name("my-env") is None and await snapshots.list() == [b]
    await snapshots.put(snapshot("c", "my-env"))  # the name is free again
    assert (await snapshots.by_name("my-env")).snapshot_id == "c"  # type: ignore[union-attr]


async def test_a_name_belongs_to_one_snapshot(database: Database) -> None:
    snapshots = Snapshots(database)
    await snapshots.put(snapshot("a", "taken", "mine"))
    with pytest.raises(Conflict, match="'taken'"):
        await snapshots.put(snapshot("b", "free", "taken"))
    assert await snapshots.get("b") is None and await snapshots.by_name("free") is None  # nothing of it was written
    with pytest.raises(Conflict):
        await snapshots.put(snapshot("a", "other"))  # its ID is taken
    assert await snapshots.by_name("other") is None
    await snapshots.put(snapshot("d", "twice", "twice"))  # a name given twice is one name
    assert (await snapshots.get("d")).names == ("twice",)  # type: ignore[union-attr]


async def test_two_racing_puts_of_one_name_one_conflicts(database: Database, held_database: HeldCommit) -> None:
    outcomes = await race(held_database,
                          lambda: Snapshots(held_database).put(snapshot("a", "env")),
                          lambda: Snapshots(database).put(snapshot("b", "env")))
    assert outcomes[0] is None and isinstance(outcomes[1], Conflict)
    assert [s.snapshot_id for s in await Snapshots(database).list()] == ["a"]
