"""Snapshots (checkpoints usable as a templateID) and their names: a name resolves to one snapshot or none, by one
indexed lookup of `snapshot_names`; a snapshot's names are written and deleted in its own transaction.

A name, or a snapshot ID, that exists already is keepstate.errors.Conflict (409): the primary keys of `snapshots`
and `snapshot_names` decide two racing puts. A snapshot's names come back sorted (their order is not stored).
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Row

from keepstate.db.engine import Database
from keepstate.db.records import SnapshotRecord
from keepstate.db.repos._sql import columns, duplicate
from keepstate.db.schema import snapshot_names, snapshots
from keepstate.errors import Conflict

_c = snapshots.c
_n = snapshot_names.c
# A snapshot's columns and each of its names (one row per name; one with a NULL name for a snapshot that has none).
_WITH_NAMES = (sa.select(snapshots, _n.name)
               .select_from(snapshots.outerjoin(snapshot_names, _n.snapshot_id == _c.snapshot_id)))


class Snapshots:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def put(self, rec: SnapshotRecord) -> None:
        """Record a new snapshot and its names; Conflict if its ID exists or another snapshot has one of them."""
        try:
            async with self.db.transaction() as conn:
                taken = (await conn.execute(sa.select(_n.name).where(_n.name.in_(rec.names)))).scalars().all()
                if taken:
                    raise Conflict(f"a snapshot named {', '.join(repr(n) for n in sorted(taken))} exists already")
                await conn.execute(snapshots.insert().values(**columns(rec, leave_out=["names"])))
                if rec.names:
                    await conn.execute(snapshot_names.insert(),
                                       [{"name": name, "snapshot_id": rec.snapshot_id} for name in set(rec.names)])
        except sa.exc.IntegrityError as e:  # the same name or ID put by another writer at the same time
            if not duplicate(e):
                raise
            raise Conflict(f"snapshot {rec.snapshot_id} or one of its names {list(rec.names)} exists already") from None

    async def get(self, snapshot_id: str) -> SnapshotRecord | None:
        async with self.db.read() as conn:
            found = _grouped(await conn.execute(_WITH_NAMES.where(_c.snapshot_id == snapshot_id)))
        return found[0] if found else None

    async def by_name(self, name: str) -> SnapshotRecord | None:
        """The snapshot that has the name `name`, with all its names, or None."""
        named = sa.select(_n.snapshot_id).where(_n.name == name).scalar_subquery()
        async with self.db.read() as conn:
            found = _grouped(await conn.execute(_WITH_NAMES.where(_c.snapshot_id == named)))
        return found[0] if found else None

    async def list(self) -> builtins.list[SnapshotRecord]:
        """Every snapshot, oldest first."""
        async with self.db.read() as conn:
            return _grouped(await conn.execute(_WITH_NAMES.order_by(_c.created_at, _c.snapshot_id)))

    async def delete(self, snapshot_id: str) -> bool:
        """Forget the snapshot and its names together; False if there was no such snapshot."""
        async with self.db.transaction() as conn:
            await conn.execute(snapshot_names.delete().where(_n.snapshot_id == snapshot_id))
            done = await conn.execute(snapshots.delete().where(_c.snapshot_id == snapshot_id))
            return done.rowcount == 1


def _grouped(rows: Iterable[Row[Any]]) -> list[SnapshotRecord]:
    """One record per snapshot of rows of _WITH_NAMES, in the order of each snapshot's first row."""
    found: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for row in rows:
        fields = dict(row._mapping)
        name = fields.pop("name")
        _, names = found.setdefault(fields["snapshot_id"], (fields, []))
        if name is not None:
            names.append(name)
    return [SnapshotRecord(**fields, names=tuple(sorted(names))) for fields, names in found.values()]
