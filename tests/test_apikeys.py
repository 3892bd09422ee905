"""API keys (keepstate/apikeys.py): issued in E2B's format, stored by hash only, and keys of our own older format
still found (what the removed tests/db/test_catalog.py checked of the catalog's keys)."""

from __future__ import annotations

import re

import sqlalchemy as sa

from keepstate.apikeys import API_KEY_FORMAT, find, hash_key, issue, new_api_key
from keepstate.db.engine import Database
from keepstate.db.repos import Keys
from keepstate.db.schema import api_keys
from keepstate.testing.databases import database, db_url, postgres  # noqa: F401


async def test_keys_are_issued_in_e2bs_format_and_older_ones_still_work(database: Database) -> None:  # noqa: F811
    """e2b 2.45 refuses a key that is not "e2b_" + hex before it sends anything; keys we issued before in our own
    "ks_" format keep working."""
    keys = Keys(database)
    key, secret = await issue(keys, "new")
    assert re.fullmatch(r"e2b_[0-9a-f]+", secret) and API_KEY_FORMAT.match(secret) and key.prefix == secret[:8]
    assert API_KEY_FORMAT.match(new_api_key()) and new_api_key() != new_api_key()
    old_key, old_secret = await issue(keys, "old", secret="ks_" + "ab" * 20)
    assert old_secret == "ks_" + "ab" * 20 and not API_KEY_FORMAT.match(old_secret)
    assert (await find(keys, old_secret)).id == old_key.id  # type: ignore[union-attr]
    assert (await find(keys, secret)).id == key.id and await find(keys, "nope") is None  # type: ignore[union-attr]


async def test_only_a_keys_hash_is_stored_and_a_revoked_key_is_not_found(database: Database) -> None:  # noqa: F811
    keys = Keys(database)
    key, secret = await issue(keys, "ci", max_sandboxes=2)
    assert key.max_sandboxes == 2 and key.name == "ci"
    async with database.read() as conn:
        stored = [tuple(r) for r in await conn.execute(sa.select(api_keys))]
    assert len(stored) == 1 and hash_key(secret) in stored[0] and not any(secret == v for v in stored[0])
    if database.url.path is not None:  # SQLite: not in any byte of its files either
        on_disk = b"".join(p.read_bytes() for p in database.url.path.parent.glob(database.url.path.name + "*"))
        assert secret.encode() not in on_disk
    assert await keys.revoke(key.id) and await find(keys, secret) is None
