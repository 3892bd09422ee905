"""Idempotent creates' keys (docs/design/idempotency.md): one row per (API key, Idempotency-Key), judged by the
database's clock; every change is conditioned on the row's state and owner, so two servers racing on one key settle
it in the database.

    keys = Idempotency(db)
    mine = IdempotencyRecord(api_key_id="k1", key="abc", digest=d, sandbox_id=sid, state="in_progress", owner=me)
    rec = await keys.begin(mine, ttl_s=86400)   # ours if rec.owner == me and rec.sandbox_id == sid
    await keys.finish("k1", "abc", me, body)                             # done, with the answer
    await keys.abandon("k1", "abc", me)                                   # the create failed: the key is free again
"""

from __future__ import annotations

import time
from dataclasses import replace

import sqlalchemy as sa

from keepstate.db.engine import Database
from keepstate.db.records import IdempotencyRecord
from keepstate.db.repos._sql import columns, insert_or_ignore, record
from keepstate.db.repos.ledger_claims import owner_gone
from keepstate.db.repos.nodes import db_now
from keepstate.db.schema import idempotency

_c = idempotency.c
PURGE_EVERY_S = 60.0  # expired keys are deleted at most this often (by the next begin)


class Idempotency:
    def __init__(self, db: Database) -> None:
        self.db = db
        self._purged = 0.0

    async def begin(self, rec: IdempotencyRecord, ttl_s: float) -> IdempotencyRecord:
        """Record `rec` (in progress, its sandbox ID and owner) unless the key has a row that has not expired (an
        expired one is replaced); the row as it stands after: `rec`'s if it was recorded, else the earlier one."""
        where = (_c.api_key_id == rec.api_key_id, _c.key == rec.key)
        async with self.db.transaction() as conn:
            now = float((await conn.execute(sa.select(db_now(self.db.kind)))).scalar_one())
            await conn.execute(idempotency.delete().where(*where, _c.expires_at < now))
            if time.monotonic() - self._purged > PURGE_EVERY_S:
                self._purged = time.monotonic()
                await conn.execute(idempotency.delete().where(_c.expires_at < now))
            values = columns(replace(rec, state="in_progress", response=None)) | {
                "created_at": now, "expires_at": now + ttl_s}
            await conn.execute(insert_or_ignore(self.db.kind, idempotency, ["api_key_id", "key"], values))
            row = (await conn.execute(sa.select(idempotency).where(*where))).one()
        return record(IdempotencyRecord, row)

    async def get(self, api_key_id: str, key: str) -> IdempotencyRecord | None:
        async with self.db.read() as conn:
            row = (await conn.execute(sa.select(idempotency).where(_c.api_key_id == api_key_id,
                                                                   _c.key == key))).first()
        return record(IdempotencyRecord, row) if row is not None else None

    async def owner_gone(self, owner: str) -> bool:
        """Whether the server incarnation `owner` is gone (it no longer holds its `nodes` row): final once true."""
        async with self.db.read() as conn:
            return await owner_gone(conn, owner, lambda _: True)

    async def take_over(self, api_key_id: str, key: str, from_owner: str, to_owner: str) -> bool:
        """Make an in-progress key of a gone owner `to_owner`'s; False if another took it first, or it changed."""
        async with self.db.transaction() as conn:
            done = await conn.execute(idempotency.update().where(
                _c.api_key_id == api_key_id, _c.key == key, _c.state == "in_progress", _c.owner == from_owner)
                .values(owner=to_owner))
            return done.rowcount == 1

    async def finish(self, api_key_id: str, key: str, owner: str, response: str, state: str = "done") -> bool:
        """The create is recorded: store its answer (`state` `done`, or `unknown` where it cannot be known); False
        if the key is no longer this owner's in-progress one."""
        async with self.db.transaction() as conn:
            done = await conn.execute(idempotency.update().where(
                _c.api_key_id == api_key_id, _c.key == key, _c.state == "in_progress", _c.owner == owner)
                .values(state=state, response=response))
            return done.rowcount == 1

    async def abandon(self, api_key_id: str, key: str, owner: str) -> bool:
        """The create failed and was answered so: the key is free again (a retry runs the create anew)."""
        async with self.db.transaction() as conn:
            done = await conn.execute(idempotency.delete().where(
                _c.api_key_id == api_key_id, _c.key == key, _c.state == "in_progress", _c.owner == owner))
            return done.rowcount == 1
