"""Secrets on SQLite and PostgreSQL: a unique name, a version and its pointer written together, paging by `seq`,
and the key's fingerprint in its one-row table."""

from __future__ import annotations

import pytest

from keepstate.db.engine import Database
from keepstate.db.records import SecretRecord
from keepstate.db.repos import Secrets
from keepstate.errors import Conflict

from .race import HeldCommit, race


def secret(secret_id: str, name: str, **metadata: str) -> SecretRecord:
    return SecretRecord(secret_id=secret_id, name=name, current_version=1, metadata=metadata, created_at=1.0,
                        updated_at=1.0)


def sealed(secret_id: str, version: int) -> bytes:
    return f"sealed:{secret_id}:{version}".encode() + bytes(range(256))  # any bytes, NULs included


async def test_put_get_by_name_sealed_count_delete(database: Database) -> None:
    secrets = Secrets(database)
    a = await secrets.put(secret("sec_a", "db-password", env="prod"), sealed("sec_a", 1))
    b = await secrets.put(secret("sec_b", "token"), sealed("sec_b", 1))
    assert 0 < a.seq < b.seq and a.metadata == {"env": "prod"}
    assert await secrets.get("sec_a") == a and await secrets.by_name("token") == b
    assert await secrets.get("nope") is None and await secrets.by_name("nope") is None
    assert await secrets.sealed("sec_a", 1) == sealed("sec_a", 1) and await secrets.sealed("sec_a", 2) is None
    assert await secrets.count() == 2
    assert await secrets.delete("sec_a") is True and await secrets.delete("sec_a") is False
    assert await secrets.get("sec_a") is None and await secrets.sealed("sec_a", 1) is None  # versions go with it
    assert await secrets.count() == 1
    again = await secrets.put(secret("sec_c", "db-password"), sealed("sec_c", 1))  # the name is free again
    assert again.seq > b.seq  # a seq is never reused


async def test_a_name_is_unique(database: Database) -> None:
    secrets = Secrets(database)
    first = await secrets.put(secret("sec_a", "token"), sealed("sec_a", 1))
    with pytest.raises(Conflict, match="a secret named 'token' exists"):
        await secrets.put(secret("sec_b", "token"), sealed("sec_b", 1))
    assert await secrets.sealed("sec_b", 1) is None and await secrets.page(0, 10) == [first]


async def test_a_new_version_and_its_pointer_change_together(database: Database) -> None:
    secrets = Secrets(database)
    await secrets.put(secret("sec_a", "token", env="prod"), sealed("sec_a", 1))
    asked: list[int] = []

    def seal(version: int) -> bytes:
        asked.append(version)
        return sealed("sec_a", version)

    assert await secrets.add_version("sec_a", seal, now=5.0) == 2 and asked == [2]
    got = await secrets.get("sec_a")
    assert got is not None and (got.current_version, got.updated_at, got.metadata) == (2, 5.0, {"env": "prod"})
    assert await secrets.add_version("sec_a", seal, metadata={"env": "dev"}, now=6.0) == 3
    got = await secrets.get("sec_a")
    assert got is not None and (got.current_version, got.metadata, got.created_at) == (3, {"env": "dev"}, 1.0)
    for version in (1, 2, 3):
        assert await secrets.sealed("sec_a", version) == sealed("sec_a", version)
    assert await secrets.add_version("sec_nope", seal) is None and asked == [2, 3]


async def test_a_version_that_cannot_be_sealed_moves_no_pointer(database: Database) -> None:
    secrets = Secrets(database)
    first = await secrets.put(secret("sec_a", "token"), sealed("sec_a", 1))

    def broken(version: int) -> bytes:
        raise RuntimeError("no key")

    with pytest.raises(RuntimeError, match="no key"):
        await secrets.add_version("sec_a", broken)
    assert await secrets.get("sec_a") == first and await secrets.sealed("sec_a", 2) is None


async def test_two_racing_updates_take_one_version_each(database: Database, held_database: HeldCommit) -> None:
    await Secrets(database).put(secret("sec_a", "token"), sealed("sec_a", 1))
    outcomes = await race(held_database,
                          lambda: Secrets(held_database).add_version("sec_a", lambda v: sealed("sec_a", v)),
                          lambda: Secrets(database).add_version("sec_a", lambda v: sealed("sec_a", v)))
    assert outcomes == [2, 3]
    assert (await Secrets(database).get("sec_a")).current_version == 3  # type: ignore[union-attr]


async def test_two_racing_creates_of_one_name_one_conflicts(database: Database, held_database: HeldCommit) -> None:
    outcomes = await race(held_database,
                          lambda: Secrets(held_database).put(secret("sec_a", "token"), sealed("sec_a", 1)),
                          lambda: Secrets(database).put(secret("sec_b", "token"), sealed("sec_b", 1)))
    assert isinstance(outcomes[0], SecretRecord) and isinstance(outcomes[1], Conflict)
    assert [s.secret_id for s in await Secrets(database).page(0, 10)] == ["sec_a"]


async def test_page_after_a_seq(database: Database) -> None:
    secrets = Secrets(database)
    put = [await secrets.put(secret(f"sec_{i}", f"s{i}"), sealed(f"sec_{i}", 1)) for i in range(5)]
    assert await secrets.page(0, 2) == put[:2]
    assert await secrets.page(put[1].seq, 2) == put[2:4]
    assert await secrets.page(put[3].seq, 2) == put[4:]
    assert await secrets.page(put[4].seq, 2) == []


async def test_the_key_fingerprint(database: Database, other_database: Database) -> None:
    secrets = Secrets(database)
    assert await secrets.key_fingerprint() is None
    await secrets.set_key_fingerprint("fp-1")
    assert await Secrets(other_database).key_fingerprint() == "fp-1"
    await secrets.set_key_fingerprint("fp-2")  # replaced, still one row
    assert await secrets.key_fingerprint() == "fp-2"
