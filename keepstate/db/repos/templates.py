"""Built templates (docs/design/template-builds.md): templates, their builds, the tags that name a build, and the
step cache's layers.

A template's name is unique: a second template of that name is keepstate.errors.Conflict (409), whatever two
writers do (the UNIQUE constraint decides). A build is published in one transaction: its status and checkpoint,
every tag moved to it and the template's `updated_at` (and, if given, its layer), so a create that resolves
`name:tag` sees all of it or none. Two publishes of one tag both succeed; the tag names the build of the one that
commits last (its upsert waits for the first's lock). Deleting a template takes its builds and tags with it, in one
transaction, and says which checkpoints they held. Layers are found by cache key, or by the checkpoint they name.

JSON documents (a build's `reason`, a layer's `state`) are stored as text and handed out decoded.
"""

from __future__ import annotations

import json
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Row

from keepstate.db.engine import Database
from keepstate.db.records import BuildRecord, LayerRecord, TagRecord, TemplateRecord
from keepstate.db.repos._sql import columns, duplicate, record, upsert
from keepstate.db.schema import template_builds, template_layers, template_tags, templates
from keepstate.db.url import Kind
from keepstate.errors import Conflict, NotFound

_t = templates.c
_b = template_builds.c
_g = template_tags.c
_l = template_layers.c

# What writing a build that exists already changes (its template and creation time are its identity).
_BUILD_CHANGES = ["status", "checkpoint_id", "sandbox_id", "reason", "finished_at"]


class Templates:
    def __init__(self, db: Database) -> None:
        self.db = db

    # -- templates --------------------------------------------------------------------------------------------------
    async def put_template(self, t: TemplateRecord) -> None:
        """Record a new template; Conflict when its name (or ID) is taken, and nothing is written."""
        try:
            async with self.db.transaction() as conn:
                await conn.execute(templates.insert().values(**columns(t)))
        except sa.exc.IntegrityError as e:
            if not duplicate(e):
                raise
            raise Conflict(f"a template named '{t.name}' exists") from None

    async def update_template(self, template_id: str, cpu: int, memory_mb: int) -> bool:
        """Set a template's limits (and its `updated_at` to now); False if there is no such template."""
        async with self.db.transaction() as conn:
            done = await conn.execute(templates.update().where(_t.template_id == template_id)
                                      .values(cpu=cpu, memory_mb=memory_mb, updated_at=time.time()))
            return done.rowcount == 1

    async def get_template(self, ref: str) -> TemplateRecord | None:
        """By ID or by name (a template whose ID is `ref` first, should another be named so)."""
        query = (sa.select(templates).where(sa.or_(_t.template_id == ref, _t.name == ref))
                 .order_by(sa.case((_t.template_id == ref, 0), else_=1)).limit(1))
        async with self.db.read() as conn:
            row = (await conn.execute(query)).first()
        return record(TemplateRecord, row) if row else None

    async def templates(self) -> list[TemplateRecord]:
        """Every template, oldest first."""
        async with self.db.read() as conn:
            rows = await conn.execute(sa.select(templates).order_by(_t.created_at, _t.template_id))
            return [record(TemplateRecord, r) for r in rows]

    async def delete_template(self, template_id: str) -> list[str]:
        """Forget a template, its builds and its tags in one transaction; the checkpoints its builds held (none if
        there was no such template)."""
        async with self.db.transaction() as conn:
            held = (await conn.execute(
                sa.select(_b.checkpoint_id)
                .where(_b.template_id == template_id, _b.checkpoint_id.is_not(None))
                .order_by(_b.created_at, _b.build_id))).scalars().all()
            for table in (templates, template_builds, template_tags):
                await conn.execute(table.delete().where(table.c.template_id == template_id))
        return [str(cp) for cp in held]

    # -- builds -----------------------------------------------------------------------------------------------------
    async def put_build(self, b: BuildRecord) -> None:
        """Write a build: a new one as given; one that exists gets `b`'s status, checkpoint, sandbox, reason and
        finish time (its template and creation time stay)."""
        async with self.db.transaction() as conn:
            await conn.execute(_upsert_some(self.db.kind, template_builds, ["build_id"], _build_columns(b),
                                            _BUILD_CHANGES))

    async def get_build(self, build_id: str) -> BuildRecord | None:
        async with self.db.read() as conn:
            row = (await conn.execute(sa.select(template_builds).where(_b.build_id == build_id))).first()
        return _build(row) if row else None

    async def builds(self, template_id: str | None = None) -> list[BuildRecord]:
        """Every build (of `template_id`, if given), oldest first."""
        query = sa.select(template_builds).order_by(_b.created_at, _b.build_id)
        if template_id is not None:
            query = query.where(_b.template_id == template_id)
        async with self.db.read() as conn:
            return [_build(r) for r in await conn.execute(query)]

    async def publish_build(self, b: BuildRecord, tags: list[str], layer: LayerRecord | None = None) -> None:
        """In one transaction: the build gets `b`'s status, checkpoint, sandbox and finish time (its reason is
        cleared), each of `tags` of its template points at it, the template's `updated_at` is now, and `layer` (if
        given) is written. NotFound, and nothing is written, if the build does not exist (its template was deleted
        meanwhile)."""
        now = time.time()
        async with self.db.transaction() as conn:
            done = await conn.execute(
                template_builds.update().where(_b.build_id == b.build_id)
                .values(status=b.status, checkpoint_id=b.checkpoint_id, sandbox_id=b.sandbox_id, reason=None,
                        finished_at=b.finished_at))
            if done.rowcount != 1:
                raise NotFound(f"build '{b.build_id}' not found")
            for tag in dict.fromkeys(tags):
                await conn.execute(self._tag(b.template_id, tag, b.build_id, now))
            await conn.execute(templates.update().where(_t.template_id == b.template_id).values(updated_at=now))
            if layer is not None:
                await conn.execute(self._layer(layer, now))

    # -- tags -------------------------------------------------------------------------------------------------------
    async def set_tag(self, template_id: str, tag: str, build_id: str) -> None:
        """Point the tag at the build (moving it if it named another)."""
        async with self.db.transaction() as conn:
            await conn.execute(self._tag(template_id, tag, build_id, time.time()))

    async def delete_tag(self, template_id: str, tag: str) -> bool:
        """False if the template had no such tag."""
        async with self.db.transaction() as conn:
            done = await conn.execute(template_tags.delete().where(_g.template_id == template_id, _g.tag == tag))
            return done.rowcount == 1

    async def tags(self, template_id: str) -> list[TagRecord]:
        """A template's tags, the oldest set first."""
        async with self.db.read() as conn:
            rows = await conn.execute(sa.select(template_tags).where(_g.template_id == template_id)
                                      .order_by(_g.created_at, _g.tag))
            return [record(TagRecord, r) for r in rows]

    async def tag_build(self, template_id: str, tag: str) -> str | None:
        """The ID of the build the tag names, or None."""
        async with self.db.read() as conn:
            found = (await conn.execute(sa.select(_g.build_id).where(_g.template_id == template_id, _g.tag == tag))
                     ).scalar_one_or_none()
        return str(found) if found is not None else None

    async def tagged_build(self, template_id: str, tag: str) -> BuildRecord | None:
        """The build the tag names (whatever its status), in one read; None if there is no such tag or build."""
        query = (sa.select(template_builds)
                 .join(template_tags, _g.build_id == _b.build_id)
                 .where(_g.template_id == template_id, _g.tag == tag))
        async with self.db.read() as conn:
            row = (await conn.execute(query)).first()
        return _build(row) if row else None

    # -- layers -----------------------------------------------------------------------------------------------------
    async def put_layer(self, cache_key: str, checkpoint_id: str, state: dict[str, Any]) -> None:
        """Record the layer of `cache_key` (replacing one recorded before)."""
        layer = LayerRecord(cache_key=cache_key, checkpoint_id=checkpoint_id, state=state)
        async with self.db.transaction() as conn:
            await conn.execute(self._layer(layer, time.time()))

    async def get_layer(self, cache_key: str) -> LayerRecord | None:
        async with self.db.read() as conn:
            row = (await conn.execute(sa.select(template_layers).where(_l.cache_key == cache_key))).first()
        return _layer(row) if row else None

    async def layers(self) -> list[LayerRecord]:
        """Every layer, oldest first."""
        async with self.db.read() as conn:
            rows = await conn.execute(sa.select(template_layers).order_by(_l.created_at, _l.cache_key))
            return [_layer(r) for r in rows]

    async def layers_of(self, checkpoint_id: str) -> list[LayerRecord]:
        """The layers that name the checkpoint."""
        async with self.db.read() as conn:
            rows = await conn.execute(sa.select(template_layers).where(_l.checkpoint_id == checkpoint_id)
                                      .order_by(_l.created_at, _l.cache_key))
            return [_layer(r) for r in rows]

    async def delete_layer(self, cache_key: str) -> bool:
        """False if there was no such layer."""
        async with self.db.transaction() as conn:
            done = await conn.execute(template_layers.delete().where(_l.cache_key == cache_key))
            return done.rowcount == 1

    async def delete_layers_of(self, checkpoint_id: str) -> list[str]:
        """Delete every layer that names the checkpoint, in one transaction; their cache keys."""
        async with self.db.transaction() as conn:
            rows = await conn.execute(template_layers.delete().where(_l.checkpoint_id == checkpoint_id)
                                      .returning(_l.cache_key))
            return sorted(str(k) for k in rows.scalars())

    # -- statements -------------------------------------------------------------------------------------------------
    def _tag(self, template_id: str, tag: str, build_id: str, now: float) -> sa.Insert:
        return upsert(self.db.kind, template_tags, ["template_id", "tag"],
                      {"template_id": template_id, "tag": tag, "build_id": build_id, "created_at": now})

    def _layer(self, layer: LayerRecord, now: float) -> sa.Insert:
        return upsert(self.db.kind, template_layers, ["cache_key"],
                      columns(layer) | {"state": json.dumps(layer.state), "created_at": now})


def _upsert_some(kind: Kind, table: sa.Table, key: list[str], values: dict[str, Any], changed: list[str]) -> sa.Insert:
    """INSERT … ON CONFLICT (key) DO UPDATE SET only the `changed` columns, on either database."""
    insert = postgresql.insert(table) if kind == "postgresql" else sqlite_dialect.insert(table)
    stmt = insert.values(**values)
    return stmt.on_conflict_do_update(index_elements=key, set_={name: stmt.excluded[name] for name in changed})


def _build_columns(b: BuildRecord) -> dict[str, Any]:
    return columns(b) | {"reason": json.dumps(b.reason) if b.reason is not None else None}


def _build(row: Row[Any]) -> BuildRecord:
    return BuildRecord(**{**row._mapping, "reason": json.loads(row.reason) if row.reason else None})


def _layer(row: Row[Any]) -> LayerRecord:
    return LayerRecord(**{**row._mapping, "state": json.loads(row.state)})
