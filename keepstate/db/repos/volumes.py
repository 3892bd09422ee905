"""Volumes (docs/design/volumes.md): a name is unique, and the UNIQUE constraint on it decides two racing creates
(the second is keepstate.errors.Conflict, 409)."""

from __future__ import annotations

import builtins

import sqlalchemy as sa

from keepstate.db.engine import Database
from keepstate.db.records import VolumeRecord
from keepstate.db.repos._sql import columns, duplicate, record
from keepstate.db.schema import volumes
from keepstate.errors import Conflict

_c = volumes.c


class Volumes:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def put(self, rec: VolumeRecord) -> None:
        """Record a new volume; Conflict if its name (or ID) is taken."""
        try:
            async with self.db.transaction() as conn:
                await conn.execute(volumes.insert().values(**columns(rec)))
        except sa.exc.IntegrityError as e:
            if not duplicate(e):
                raise
            raise Conflict(f"a volume named '{rec.name}' exists") from None

    async def get(self, volume_id: str) -> VolumeRecord | None:
        return await self._one(_c.volume_id == volume_id)

    async def by_name(self, name: str) -> VolumeRecord | None:
        return await self._one(_c.name == name)

    async def list(self) -> builtins.list[VolumeRecord]:
        """Every volume, oldest first."""
        async with self.db.read() as conn:
            rows = await conn.execute(sa.select(volumes).order_by(_c.created_at, _c.volume_id))
            return [record(VolumeRecord, r) for r in rows]

    async def delete(self, volume_id: str) -> bool:
        """Forget the volume; False if there was none. (The design's "refused while a sandbox row mounts it" needs the
        mounts out of `sandboxes.doc` first: the caller checks for now.)"""
        async with self.db.transaction() as conn:
            done = await conn.execute(volumes.delete().where(_c.volume_id == volume_id))
            return done.rowcount == 1

    async def _one(self, where: sa.ColumnElement[bool]) -> VolumeRecord | None:
        async with self.db.read() as conn:
            row = (await conn.execute(sa.select(volumes).where(where))).first()
        return record(VolumeRecord, row) if row else None
