"""Secrets (keepstate/secret/): values arrive and leave sealed; this module never sees one in the clear.

A name is unique (the UNIQUE constraint decides two racing creates: keepstate.errors.Conflict, 409). A new version
and the secret's pointer to it (`current_version`) change in one transaction, the pointer first: its UPDATE takes
the row's lock, so two racing updates number their versions one after the other instead of both taking the same.
The key every secret is sealed with is known by its fingerprint, in the one-row `secrets_key`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Row

from keepstate.db.engine import Database
from keepstate.db.records import SecretRecord
from keepstate.db.repos._sql import columns, duplicate, upsert
from keepstate.db.schema import secret_versions, secrets, secrets_key
from keepstate.errors import Conflict

_c = secrets.c
_v = secret_versions.c


class Secrets:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def put(self, rec: SecretRecord, sealed: bytes) -> SecretRecord:
        """Record a new secret and its version `rec.current_version` (1 for a new one), sealed; the record with the
        `seq` the database gave it. Conflict if the name (or ID) is taken."""
        values = columns(rec, leave_out=["seq"]) | {"metadata": json.dumps(rec.metadata)}
        try:
            async with self.db.transaction() as conn:
                seq = (await conn.execute(secrets.insert().values(**values).returning(_c.seq))).scalar_one()
                await conn.execute(secret_versions.insert().values(
                    secret_id=rec.secret_id, version=rec.current_version, sealed=sealed, created_at=rec.created_at))
        except sa.exc.IntegrityError as e:
            if not duplicate(e):
                raise
            raise Conflict(f"a secret named '{rec.name}' exists") from None
        return SecretRecord(secret_id=rec.secret_id, name=rec.name, current_version=rec.current_version,
                            metadata=rec.metadata, created_at=rec.created_at, updated_at=rec.updated_at, seq=seq)

    async def add_version(self, secret_id: str, seal: Callable[[int], bytes], metadata: dict[str, str] | None = None,
                          now: float | None = None) -> int | None:
        """Store the secret's next version and point the secret at it, together; the new version's number (None: no
        such secret). `seal(version)` gives its ciphertext: it is called inside the transaction, once the number is
        known, because a sealed value names its version (the AEAD's associated data). `metadata`, unless None,
        replaces the stored one."""
        now = time.time() if now is None else now
        changes: dict[str, Any] = {"current_version": _c.current_version + 1, "updated_at": now}
        if metadata is not None:
            changes["metadata"] = json.dumps(metadata)
        async with self.db.transaction() as conn:
            version = (await conn.execute(secrets.update().where(_c.secret_id == secret_id).values(**changes)
                                          .returning(_c.current_version))).scalar_one_or_none()
            if version is None:
                return None
            await conn.execute(secret_versions.insert().values(secret_id=secret_id, version=version,
                                                               sealed=seal(version), created_at=now))
        return int(version)

    async def get(self, secret_id: str) -> SecretRecord | None:
        return await self._one(_c.secret_id == secret_id)

    async def by_name(self, name: str) -> SecretRecord | None:
        return await self._one(_c.name == name)

    async def page(self, after_seq: int, limit: int) -> list[SecretRecord]:
        """Up to `limit` secrets created after the one numbered `after_seq` (0: from the first), oldest first."""
        async with self.db.read() as conn:
            rows = await conn.execute(sa.select(secrets).where(_c.seq > after_seq).order_by(_c.seq).limit(limit))
            return [_secret(r) for r in rows]

    async def sealed(self, secret_id: str, version: int) -> bytes | None:
        """The ciphertext of one version of the secret, or None."""
        async with self.db.read() as conn:
            found = (await conn.execute(sa.select(_v.sealed).where(_v.secret_id == secret_id, _v.version == version))
                     ).scalar_one_or_none()
        return bytes(found) if found is not None else None

    async def count(self) -> int:
        async with self.db.read() as conn:
            return int((await conn.execute(sa.select(sa.func.count()).select_from(secrets))).scalar_one())

    async def delete(self, secret_id: str) -> bool:
        """Forget the secret and every version's ciphertext together; False if there was no such secret."""
        async with self.db.transaction() as conn:
            await conn.execute(secret_versions.delete().where(_v.secret_id == secret_id))
            done = await conn.execute(secrets.delete().where(_c.secret_id == secret_id))
            return done.rowcount == 1

    # -- the key's fingerprint --------------------------------------------------------------------------------------
    async def key_fingerprint(self) -> str | None:
        """The fingerprint of the key the stored secrets are sealed with (None: never set)."""
        async with self.db.read() as conn:
            found = (await conn.execute(sa.select(secrets_key.c.fingerprint))).scalar_one_or_none()
        return str(found) if found is not None else None

    async def set_key_fingerprint(self, fingerprint: str) -> None:
        async with self.db.transaction() as conn:
            await conn.execute(upsert(self.db.kind, secrets_key, ["id"], {"id": 1, "fingerprint": fingerprint}))

    async def _one(self, where: sa.ColumnElement[bool]) -> SecretRecord | None:
        async with self.db.read() as conn:
            row = (await conn.execute(sa.select(secrets).where(where))).first()
        return _secret(row) if row else None


def _secret(row: Row[Any]) -> SecretRecord:
    fields = dict(row._mapping)
    return SecretRecord(**fields | {"metadata": json.loads(fields["metadata"])})
