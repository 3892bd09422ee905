"""API keys: stored by hash only, found by one indexed read of that hash, never found again once revoked.

    key = await keys.create("ci", key_hash=hash_key(secret), prefix=secret[:8])
    await keys.find(hash_key(secret))        # the key, or None (unknown or revoked)
    await keys.revoke("ci")                  # by ID, or by a name that one active key has
"""

from __future__ import annotations

import secrets
import time

import sqlalchemy as sa

from keepstate.db.engine import Database
from keepstate.db.records import KeyRecord
from keepstate.db.repos._sql import duplicate, record
from keepstate.db.schema import api_keys
from keepstate.errors import BadRequest, Conflict

_SHOWN = [api_keys.c.id, api_keys.c.name, api_keys.c.prefix, api_keys.c.created_at, api_keys.c.revoked_at,
          api_keys.c.max_sandboxes]  # every column but the hash


class Keys:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(self, name: str, key_hash: str, prefix: str, max_sandboxes: int | None = None) -> KeyRecord:
        """A new key whose secret hashes to `key_hash`; Conflict if a key (even a revoked one) has that hash."""
        key = KeyRecord(id="key_" + secrets.token_hex(6), name=name, prefix=prefix, created_at=time.time(),
                        max_sandboxes=max_sandboxes)
        try:
            async with self.db.transaction() as conn:
                await conn.execute(api_keys.insert().values(
                    id=key.id, name=key.name, key_hash=key_hash, prefix=key.prefix, created_at=key.created_at,
                    max_sandboxes=key.max_sandboxes))
        except sa.exc.IntegrityError as e:
            if not duplicate(e):
                raise
            raise Conflict("that key exists already") from None
        return key

    async def get(self, key_id: str) -> KeyRecord | None:
        async with self.db.read() as conn:
            row = (await conn.execute(sa.select(*_SHOWN).where(api_keys.c.id == key_id))).first()
        return record(KeyRecord, row) if row else None

    async def find(self, key_hash: str) -> KeyRecord | None:
        """The active key whose secret hashes to `key_hash` (the UNIQUE index on key_hash), or None."""
        async with self.db.read() as conn:
            row = (await conn.execute(sa.select(*_SHOWN).where(api_keys.c.key_hash == key_hash,
                                                               api_keys.c.revoked_at.is_(None)))).first()
        return record(KeyRecord, row) if row else None

    async def list(self) -> list[KeyRecord]:
        """Every key, revoked ones included, oldest first."""
        async with self.db.read() as conn:
            rows = await conn.execute(sa.select(*_SHOWN).order_by(api_keys.c.created_at, api_keys.c.id))
            return [record(KeyRecord, r) for r in rows]

    async def revoke(self, id_or_name: str) -> bool:
        """Revoke the active key with this ID or, failing that, the one active key with this name; False if there is
        none, BadRequest if several active keys have the name. Once it returns, `find` never finds the key again."""
        active = api_keys.c.revoked_at.is_(None)
        async with self.db.transaction() as conn:
            ids = list((await conn.execute(sa.select(api_keys.c.id).where(active, api_keys.c.id == id_or_name)))
                       .scalars())
            if not ids:
                ids = list((await conn.execute(sa.select(api_keys.c.id).where(active, api_keys.c.name == id_or_name)))
                           .scalars())
            if len(ids) > 1:
                raise BadRequest(f"{len(ids)} active keys are named {id_or_name!r}: name one by its ID")
            if not ids:
                return False
            done = await conn.execute(api_keys.update().where(api_keys.c.id == ids[0], active)
                                      .values(revoked_at=time.time()))
            return done.rowcount == 1

    async def set_limit(self, key_id: str, max_sandboxes: int | None) -> bool:
        """A key's own limit of running sandboxes (0: unlimited; None: the server's default); False: no such key."""
        async with self.db.transaction() as conn:
            done = await conn.execute(api_keys.update().where(api_keys.c.id == key_id)
                                      .values(max_sandboxes=max_sandboxes))
            return done.rowcount == 1
