"""Keys on SQLite and PostgreSQL: found by hash only while active, revoked by ID or by an unambiguous name."""

from __future__ import annotations

import dataclasses

import pytest

from keepstate.db.engine import Database
from keepstate.db.records import KeyRecord
from keepstate.db.repos import Keys
from keepstate.errors import BadRequest, Conflict


async def test_create_get_find_and_list(database: Database) -> None:
    keys = Keys(database)
    ci = await keys.create("ci", key_hash="h1", prefix="e2b_1234", max_sandboxes=3)
    dev = await keys.create("dev", key_hash="h2", prefix="e2b_5678")
    assert ci.id.startswith("key_") and ci.name == "ci" and ci.prefix == "e2b_1234" and ci.max_sandboxes == 3
    assert ci.revoked_at is None and dev.max_sandboxes is None
    assert await keys.get(ci.id) == ci and await keys.get("key_nope") is None
    assert await keys.find("h1") == ci and await keys.find("h2") == dev and await keys.find("h3") is None
    assert await keys.list() == sorted([ci, dev], key=lambda k: (k.created_at, k.id))
    assert "key_hash" not in {f.name for f in dataclasses.fields(KeyRecord)}  # the hash is asked for, never handed out


async def test_a_hash_is_one_key(database: Database) -> None:
    keys = Keys(database)
    first = await keys.create("a", key_hash="same", prefix="p")
    with pytest.raises(Conflict):
        await keys.create("b", key_hash="same", prefix="p")
    assert await keys.list() == [first]


async def test_a_revoked_key_is_never_found_again(database: Database, other_database: Database) -> None:
    keys, elsewhere = Keys(database), Keys(other_database)
    key = await keys.create("ci", key_hash="h", prefix="p")
    assert await elsewhere.find("h") == key
    assert await keys.revoke(key.id) is True
    assert await elsewhere.find("h") is None and await keys.find("h") is None  # another server's next read too
    revoked = await keys.get(key.id)
    assert revoked is not None and revoked.revoked_at is not None
    assert await keys.revoke(key.id) is False  # already revoked
    assert await keys.list() == [revoked]


async def test_revoke_by_name(database: Database) -> None:
    keys = Keys(database)
    a = await keys.create("ci", key_hash="h1", prefix="p")
    assert await keys.revoke("nobody") is False
    assert await keys.revoke("ci") is True and await keys.find("h1") is None
    b = await keys.create("ci", key_hash="h2", prefix="p")  # the name is free among active keys again
    await keys.create("ci", key_hash="h3", prefix="p")
    with pytest.raises(BadRequest, match="2 active keys are named 'ci'"):
        await keys.revoke("ci")
    assert await keys.find("h2") == b  # nothing was revoked
    assert await keys.revoke(b.id) is True and await keys.revoke("ci") is True  # one left by that name: that one
    assert await keys.find("h3") is None and (await keys.get(a.id)) is not None


async def test_set_limit(database: Database) -> None:
    keys = Keys(database)
    key = await keys.create("ci", key_hash="h", prefix="p")
    assert await keys.set_limit(key.id, 5) is True
    assert (await keys.find("h")) == dataclasses.replace(key, max_sandboxes=5)
    assert await keys.set_limit(key.id, 0) is True and (await keys.get(key.id)).max_sandboxes == 0  # type: ignore
    assert await keys.set_limit(key.id, None) is True and await keys.get(key.id) == key
    assert await keys.set_limit("key_nope", 1) is False
