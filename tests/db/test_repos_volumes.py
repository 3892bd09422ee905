"""Volumes on SQLite and PostgreSQL: a name is unique, even for two creates at once."""

from __future__ import annotations

import pytest

from keepstate.db.engine import Database
from keepstate.db.records import VolumeRecord
from keepstate.db.repos import Volumes
from keepstate.errors import Conflict

from .race import HeldCommit, race


def volume(volume_id: str, name: str, created_at: float = 1.0) -> VolumeRecord:
    return VolumeRecord(volume_id=volume_id, name=name, token=f"tok-{volume_id}", size_mb=1024, created_at=created_at)


async def test_put_get_by_name_list_delete(database: Database) -> None:
    volumes = Volumes(database)
    a, b = volume("vol_a", "data", 2.0), volume("vol_b", "cache", 1.0)
    await volumes.put(a)
    await volumes.put(b)
    assert await volumes.get("vol_a") == a and await volumes.get("nope") is None
    assert await volumes.by_name("cache") == b and await volumes.by_name("vol_a") is None
    assert await volumes.list() == [b, a]
    assert await volumes.delete("vol_a") is True and await volumes.delete("vol_a") is False
    assert await volumes.list() == [b] and await volumes.by_name("data") is None
    await volumes.put(volume("vol_c", "data"))  # the name is free again
    assert (await volumes.by_name("data")).volume_id == "vol_c"  # type: ignore[union-attr]


async def test_a_name_is_unique(database: Database) -> None:
    volumes = Volumes(database)
    await volumes.put(volume("vol_a", "data"))
    with pytest.raises(Conflict, match="a volume named 'data' exists"):
        await volumes.put(volume("vol_b", "data"))
    assert [v.volume_id for v in await volumes.list()] == ["vol_a"]


async def test_two_racing_creates_of_one_name_one_conflicts(database: Database, held_database: HeldCommit) -> None:
    outcomes = await race(held_database,
                          lambda: Volumes(held_database).put(volume("vol_a", "data")),
                          lambda: Volumes(database).put(volume("vol_b", "data")))
    assert outcomes[0] is None and isinstance(outcomes[1], Conflict)
    assert [v.volume_id for v in await Volumes(database).list()] == ["vol_a"]
