"""Sandboxes: the rows the sandbox table owns, and the teardowns that outlive them.

Every change to a row is conditioned on the version (and epoch) its writer last saw (docs/design/database.md,
"Concurrency rules"):

    UPDATE sandboxes SET state = :to, …, version = version + 1
     WHERE sandbox_id = :id AND version = :v AND epoch = :e

Zero rows updated is never a silent overwrite: a second read in the same transaction says which of `Fenced` (the
epoch moved: another owner has the sandbox), `Stale` (the version moved) or NotFound (the row is gone) it was.

A teardown (an instance still to destroy) is recorded in the transaction that deletes or changes the row it
replaces, so a crash leaves one of the two, never neither. Recording one for an instance already recorded keeps the
first record (its attempts and schedule), as the catalog did: a kill retried after a failure does not reset it.

`insert` and `claim_pooled` raise keepstate.errors.Conflict (409) for a sandbox ID that exists already.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Collection

import sqlalchemy as sa

from keepstate.db.engine import Conn, Database
from keepstate.db.errors import Fenced, Stale
from keepstate.db.records import SandboxRecord, TeardownRecord
from keepstate.db.repos._sql import columns, duplicate, insert_or_ignore, record
from keepstate.db.repos.nodes import db_now
from keepstate.db.schema import nodes, sandboxes, teardowns
from keepstate.errors import Conflict, NotFound

POOLED = "pooled"  # the state of a sandbox started ahead of demand, which `claim_pooled` hands to a user
GONE_NODE_STATES = ("dead", "left", "removed")  # a node in these holds no sandbox: another may take them over
LAST_ERROR_MAX = 2000  # characters of a failed teardown's message that are kept

_c = sandboxes.c
# What a transition may change: everything but the row's identity, the two tokens it is conditioned on, and
# `paused_at`, which follows the state it writes (_paused).
CHANGEABLE = frozenset(c.name for c in sandboxes.c) - {"sandbox_id", "version", "epoch", "paused_at"}
KEEP_PAUSED_AT = ("resuming", "killing")  # on the way out of `paused`: it keeps the time it was paused


class Sandboxes:
    def __init__(self, db: Database) -> None:
        self.db = db

    # -- rows -------------------------------------------------------------------------------------------------------
    async def insert(self, rec: SandboxRecord) -> None:
        """Write a new row as given (its version and epoch included); Conflict if its ID exists."""
        try:
            async with self.db.transaction() as conn:
                await conn.execute(sandboxes.insert().values(
                    **columns(rec) | {"paused_at": db_now(self.db.kind) if rec.state == "paused" else None}))
        except sa.exc.IntegrityError as e:
            if not duplicate(e):
                raise
            raise Conflict(f"sandbox {rec.sandbox_id} exists already") from None

    async def get(self, sandbox_id: str) -> SandboxRecord | None:
        async with self.db.read() as conn:
            row = (await conn.execute(sa.select(sandboxes).where(_c.sandbox_id == sandbox_id))).first()
        return record(SandboxRecord, row) if row else None

    async def list(self, node_id: str, states: Collection[str] | None = None) -> builtins.list[SandboxRecord]:
        """The node's sandboxes (in `states`, if given), oldest first: one read of the (node_id, state) index."""
        query = sa.select(sandboxes).where(_c.node_id == node_id)
        if states is not None:
            query = query.where(_c.state.in_(builtins.list(states)))
        async with self.db.read() as conn:
            rows = await conn.execute(query.order_by(_c.started_at, _c.sandbox_id))
            return [record(SandboxRecord, r) for r in rows]

    async def owner_node(self, sandbox_id: str) -> tuple[str, str, str, int] | None:
        """(node, its address, its state, the row's epoch) of the node whose row the sandbox is, in one read; the
        address and state are empty for a node that never joined. None: no such sandbox."""
        query = (sa.select(_c.node_id, nodes.c.address, nodes.c.state, _c.epoch)
                 .select_from(sandboxes.outerjoin(nodes, nodes.c.node_id == _c.node_id))
                 .where(_c.sandbox_id == sandbox_id))
        async with self.db.read() as conn:
            row = (await conn.execute(query)).first()
        return (row.node_id, row.address or "", row.state or "", int(row.epoch)) if row is not None else None

    async def others(self, node_id: str, states: Collection[str]) -> builtins.list[SandboxRecord]:
        """Every other node's sandboxes in `states`, oldest first (a cluster-wide list)."""
        query = sa.select(sandboxes).where(_c.node_id != node_id, _c.state.in_(tuple(states))).order_by(_c.started_at)
        async with self.db.read() as conn:
            return [record(SandboxRecord, r) for r in await conn.execute(query)]

    async def used_slots(self, node_id: str) -> set[int]:
        """The slots the node's rows hold (a slot below 0 is none)."""
        async with self.db.read() as conn:
            rows = await conn.execute(sa.select(_c.slot).where(_c.node_id == node_id, _c.slot >= 0))
            return set(rows.scalars())

    async def transition(self, sandbox_id: str, expect_version: int, expect_epoch: int, *,
                         teardown: TeardownRecord | None = None, **changes: object) -> int:
        """Set `changes` (columns of CHANGEABLE) on the row if it is still at `expect_version` and `expect_epoch`,
        and record `teardown` with it; the row's new version. Fenced, Stale or NotFound, with nothing written, if
        not."""
        _changeable("transition", changes)
        async with self.db.transaction() as conn:
            done = await conn.execute(
                sandboxes.update()
                .where(_c.sandbox_id == sandbox_id, _c.version == expect_version, _c.epoch == expect_epoch)
                .values(version=_c.version + 1, **changes, **_paused(self.db.kind, changes)))
            if done.rowcount != 1:
                await _refuse(conn, sandbox_id, expect_version, expect_epoch)
            if teardown is not None:
                await conn.execute(self._teardown(teardown))
        return expect_version + 1

    async def take_over(self, sandbox_id: str, to_node: str, states: Collection[str] = ("paused", "resuming"), *,
                        expect_version: int | None = None, **changes: object) -> SandboxRecord | None:
        """Move a sandbox (in one of `states`, and at `expect_version` if given) from a node that is no longer live
        (dead, left or removed, by its `nodes` row) to `to_node`, in one transaction, setting `changes` (columns of
        CHANGEABLE) with it: its epoch moves on, so whatever the old owner still tries to write of it is refused
        (Fenced). The row as moved, its state `paused`; None if it is not there, not in those states or at that
        version, or its node is still live (or already `to_node`)."""
        _changeable("take_over", changes)
        conditions = [_c.sandbox_id == sandbox_id, _c.state.in_(tuple(states)), _c.node_id != to_node,
                      _c.node_id.in_(sa.select(nodes.c.node_id).where(nodes.c.state.in_(GONE_NODE_STATES)))]
        if expect_version is not None:
            conditions.append(_c.version == expect_version)
        moved = {"state": "paused", **changes}
        async with self.db.transaction() as conn:
            done = await conn.execute(
                sandboxes.update().where(*conditions)
                .values(node_id=to_node, epoch=_c.epoch + 1, version=_c.version + 1, **moved,
                        **_paused(self.db.kind, moved))
                .returning(*sandboxes.c))
            row = done.first()
        return record(SandboxRecord, row) if row is not None else None

    async def hand_over(self, sandbox_id: str, to_node: str, expect_version: int, expect_epoch: int,
                        **changes: object) -> SandboxRecord:
        """The owner gives a paused sandbox to a live node `to_node` (a drain), at the version and epoch it holds it
        at, setting `changes` with it: the epoch moves on. The row as handed over; Fenced, Stale or NotFound, with
        nothing written, if the owner's view is not the row's, and Conflict if `to_node` is not live."""
        _changeable("hand_over", changes)
        live = sa.select(nodes.c.node_id).where(nodes.c.node_id == to_node, nodes.c.state == "alive")
        async with self.db.transaction() as conn:
            done = await conn.execute(
                sandboxes.update()
                .where(_c.sandbox_id == sandbox_id, _c.version == expect_version, _c.epoch == expect_epoch,
                       _c.state == "paused", live.exists())
                .values(node_id=to_node, epoch=_c.epoch + 1, version=_c.version + 1, **changes)
                .returning(*sandboxes.c))
            row = done.first()
            if row is None:
                found = (await conn.execute(sa.select(_c.version, _c.epoch).where(_c.sandbox_id == sandbox_id))).first()
                if found is None or (found.version, found.epoch) != (expect_version, expect_epoch):
                    await _refuse(conn, sandbox_id, expect_version, expect_epoch)
                raise Conflict(f"sandbox {sandbox_id} is not paused, or node {to_node} is not alive")
        return record(SandboxRecord, row)

    async def handed(self, node_id: str) -> builtins.list[SandboxRecord]:
        """The node's paused rows handed to it to resume at once (`resume_pending`: `--on-stop handover`)."""
        query = sa.select(sandboxes).where(_c.node_id == node_id, _c.state == "paused", _c.resume_pending)
        async with self.db.read() as conn:
            return [record(SandboxRecord, r) for r in await conn.execute(query.order_by(_c.sandbox_id))]

    async def take_handed(self, sandbox_id: str, node_id: str) -> bool:
        """Clear a handed row's `resume_pending` (the node resumes it now); False if it was not pending any more."""
        async with self.db.transaction() as conn:
            done = await conn.execute(sandboxes.update().where(
                _c.sandbox_id == sandbox_id, _c.node_id == node_id, _c.resume_pending)
                .values(resume_pending=False, version=_c.version + 1))
            return done.rowcount == 1

    async def on_gone_nodes(self, states: Collection[str], limit: int = 100) -> builtins.list[SandboxRecord]:
        """Sandboxes in `states` whose node is gone (dead, left or removed): what a live node takes over."""
        gone = sa.select(nodes.c.node_id).where(nodes.c.state.in_(GONE_NODE_STATES))
        query = (sa.select(sandboxes).where(_c.state.in_(tuple(states)), _c.node_id.in_(gone))
                 .order_by(_c.started_at, _c.sandbox_id).limit(limit))
        async with self.db.read() as conn:
            return [record(SandboxRecord, r) for r in await conn.execute(query)]

    async def paused_longer_than(self, seconds: float, node_id: str,
                                 sandbox_id: str | None = None) -> builtins.list[str]:
        """The sandboxes paused for more than `seconds` by the database's clock, the longest first: `node_id`'s own
        and those of nodes that are gone (only `sandbox_id`, if given). A paused row without `paused_at` (paused
        before revision 0003, or imported from an older release's files) is stamped now: it counts from here."""
        now = db_now(self.db.kind)
        gone = sa.select(nodes.c.node_id).where(nodes.c.state.in_(GONE_NODE_STATES))
        where = [_c.state == "paused", sa.or_(_c.node_id == node_id, _c.node_id.in_(gone))]
        if sandbox_id is not None:
            where.append(_c.sandbox_id == sandbox_id)
        async with self.db.transaction() as conn:
            await conn.execute(sandboxes.update().where(*where, _c.paused_at.is_(None)).values(paused_at=now))
            rows = await conn.execute(sa.select(_c.sandbox_id).where(*where, _c.paused_at < now - seconds)
                                      .order_by(_c.paused_at, _c.sandbox_id))
            return list(rows.scalars())

    async def claim_pooled(self, pooled_id: str, rec: SandboxRecord) -> None:
        """Replace the pooled row `pooled_id` by `rec` (the user's ID) in one transaction: Stale if that row is gone
        or no longer pooled (another claim or a reap came first), Conflict if `rec`'s ID exists; nothing changes
        then."""
        try:
            async with self.db.transaction() as conn:
                gone = await conn.execute(sandboxes.delete().where(_c.sandbox_id == pooled_id, _c.state == POOLED))
                if gone.rowcount != 1:
                    raise Stale(f"pooled sandbox {pooled_id} was claimed or reaped meanwhile")
                await conn.execute(sandboxes.insert().values(**columns(rec)))
        except sa.exc.IntegrityError as e:
            if not duplicate(e):
                raise
            raise Conflict(f"sandbox {rec.sandbox_id} exists already") from None

    async def delete(self, sandbox_id: str, teardown: TeardownRecord | None = None, *,
                     expect_version: int | None = None, expect_epoch: int | None = None) -> bool:
        """Delete the row and record `teardown` in one transaction (both or neither); False if there was no row (the
        teardown is recorded all the same). With `expect_version` / `expect_epoch`, only a row still at them is
        deleted: Stale, Fenced or NotFound otherwise, and nothing is written."""
        conditions = [_c.sandbox_id == sandbox_id]
        if expect_version is not None:
            conditions.append(_c.version == expect_version)
        if expect_epoch is not None:
            conditions.append(_c.epoch == expect_epoch)
        async with self.db.transaction() as conn:
            if teardown is not None:
                await conn.execute(self._teardown(teardown))
            done = await conn.execute(sandboxes.delete().where(*conditions))
            if done.rowcount != 1 and len(conditions) > 1:
                await _refuse(conn, sandbox_id, expect_version, expect_epoch)
            return done.rowcount == 1

    # -- teardowns --------------------------------------------------------------------------------------------------
    async def add_teardown(self, teardown: TeardownRecord) -> None:
        """Record a teardown that replaces no row (an instance a pause retired, an orphan); one already recorded for
        the instance is kept as it is."""
        async with self.db.transaction() as conn:
            await conn.execute(self._teardown(teardown))

    async def teardowns(self, node_id: str) -> builtins.list[TeardownRecord]:
        """Every unfinished teardown of the node's host, the first due first."""
        async with self.db.read() as conn:
            rows = await conn.execute(sa.select(teardowns).where(teardowns.c.node_id == node_id)
                                      .order_by(teardowns.c.next_try, teardowns.c.runtime_name))
            return [record(TeardownRecord, r) for r in rows]

    async def teardown_failed(self, runtime_name: str, error: str, next_try: float) -> int | None:
        """Count a failed attempt, keep what it said and when to try next; the attempts so far (None: no such
        teardown)."""
        async with self.db.transaction() as conn:
            done = await conn.execute(
                teardowns.update().where(teardowns.c.runtime_name == runtime_name)
                .values(attempts=teardowns.c.attempts + 1, next_try=next_try, last_error=error[:LAST_ERROR_MAX])
                .returning(teardowns.c.attempts))
            attempts = done.scalar_one_or_none()
        return int(attempts) if attempts is not None else None

    async def delete_teardown(self, runtime_name: str) -> bool:
        async with self.db.transaction() as conn:
            done = await conn.execute(teardowns.delete().where(teardowns.c.runtime_name == runtime_name))
            return done.rowcount == 1

    def _teardown(self, teardown: TeardownRecord) -> sa.Insert:
        return insert_or_ignore(self.db.kind, teardowns, ["runtime_name"],
                                columns(teardown) | {"created_at": time.time()})


def _paused(kind: str, changes: dict[str, object]) -> dict[str, object]:
    """What `paused_at` becomes with a write of `changes`: the database's now when the row becomes paused (kept if it
    was paused already), kept on the way out of it (resuming, killing), cleared in any other state."""
    if "state" not in changes or changes["state"] in KEEP_PAUSED_AT:
        return {}
    if changes["state"] == "paused":
        return {"paused_at": sa.func.coalesce(_c.paused_at, db_now(kind))}
    return {"paused_at": None}


def _changeable(what: str, changes: dict[str, object]) -> None:
    """TypeError unless every column `changes` names may be changed (CHANGEABLE)."""
    unknown = set(changes) - CHANGEABLE
    if unknown:
        raise TypeError(f"{what} cannot set {', '.join(sorted(unknown))}: it changes only "
                        f"{', '.join(sorted(CHANGEABLE))}")


async def _refuse(conn: Conn, sandbox_id: str, expect_version: int | None,
                  expect_epoch: int | None) -> None:
    """Raise why a conditional write of the row matched nothing (read in the writer's transaction)."""
    row = (await conn.execute(sa.select(_c.version, _c.epoch).where(_c.sandbox_id == sandbox_id))).first()
    if row is None:
        raise NotFound(f"sandbox {sandbox_id} not found")
    if expect_epoch is not None and row.epoch != expect_epoch:
        raise Fenced(f"sandbox {sandbox_id} is at epoch {row.epoch}, not {expect_epoch}: another owner has it")
    raise Stale(f"sandbox {sandbox_id} is at version {row.version}, not {expect_version}: it changed meanwhile")
