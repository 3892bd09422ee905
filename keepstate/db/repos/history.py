"""History: sessions' hash-chained events, their heads and journal cursors, and the lineage (sessions, checkpoints).

The chain itself (what an event's hash is, what the first event links to) belongs to keepstate.session; this
repository stores and returns rows. Where the next event depends on the head read in the transaction, the caller
passes a `Link`: a pure function from the session's head to its next event, called inside the write transaction
with the session's head row locked. So a chain never forks, whatever two writers (two servers, two processes) do:

    SQLite       the write transaction holds the database's write lock from its BEGIN IMMEDIATE;
    PostgreSQL   the head row is created if missing (INSERT … ON CONFLICT DO NOTHING, which waits for a concurrent
                 insert of it) and read FOR UPDATE: a second writer waits there, then reads the first one's head.

The events' primary key (session_id, seq) stands behind both: two rows at one seq can never be written.

    await history.extend("s1", [link])                         # after whatever the head is now
    await history.append("s1", events, expect_head=(3, h3))    # after (3, h3) exactly, or Stale
    await history.append_journal("s1", 7, links, 9)           # only if the journal cursor is still 7, else None

A head row at seq 0 holds only a journal cursor (its session has no event yet); for the chain it is no head.

Fencing (docs/design/cluster.md, "Fencing"): a writer may say, per session, which sandbox row it writes for and at
which (node, epoch) it holds it (`fence`). Every append then reads that row in its transaction (FOR SHARE on
PostgreSQL, so a take-over waits for the append or the append sees the take-over) and writes nothing, raising
Fenced, if another node or a later epoch holds it: a node that lost a sandbox cannot extend its history.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects import sqlite as sqlite_dialect

from keepstate.db.engine import Conn, Database
from keepstate.db.errors import Fenced, Stale
from keepstate.db.records import CheckpointRecord, EventRecord, HeadRecord, SessionRecord
from keepstate.db.repos._sql import columns, insert_or_ignore, record
from keepstate.db.schema import checkpoints, events, heads, sandboxes, sessions
from keepstate.errors import Conflict

NO_EVENT_HASH = "0" * 64  # the `hash` of a head row at seq 0 (a journal cursor only), as sessions.sqlite wrote it

Link = Callable[[HeadRecord | None], EventRecord]
"""The next event of a session, given its head (None: the session has no event yet). Pure and quick: it runs inside
the write transaction, with the head locked."""

Chain = tuple[str, tuple[int, str] | None, Sequence[EventRecord]]
"""(session_id, the (seq, hash) its events continue (None: the session has none yet), the events in seq order)."""

Fence = Callable[[str], tuple[str, str, int] | None]
"""A session's writer's claim: (sandbox_id, node_id, epoch) of the row it writes the session for; None: no claim."""

_e, _h, _s, _c = events.c, heads.c, sessions.c, checkpoints.c


class _Refused(Exception):
    """A condition checked inside a write transaction failed: roll it back, nothing written."""


class History:
    def __init__(self, db: Database, fence: Fence | None = None) -> None:
        self.db = db
        self.fence = fence

    # -- appending --------------------------------------------------------------------------------------------------
    async def extend(self, session_id: str, links: Sequence[Link]) -> list[EventRecord]:
        """Append one event per link in one transaction, each after the head as it is then; the events written."""
        if not links:
            return []
        async with self.db.transaction() as conn:
            head = await self._lock_head(conn, session_id)
            return await self._link(conn, session_id, head, links)

    async def append(self, session_id: str, events_: Sequence[EventRecord],
                     expect_head: tuple[int, str] | None) -> None:
        """Insert `events_` (already linked, in seq order) after the session's head if that is still `expect_head`
        ((seq, hash) of its last event; None: it has no event): Stale, with nothing written, if it moved.
        ValueError if the events do not continue `expect_head` seq by seq."""
        await self.append_chains([(session_id, expect_head, events_)])

    async def append_chains(self, chains: Sequence[Chain]) -> None:
        """`append` for several sessions in one transaction: all of them or none (Stale, ValueError)."""
        for session_id, expect, evs in chains:
            _continues(session_id, expect, evs)
        async with self.db.transaction() as conn:
            for session_id, expect in sorted((c[0], c[1]) for c in chains):  # one lock order: no deadlock
                head = await self._lock_head(conn, session_id)
                have = (head.seq, head.hash) if head is not None and head.seq > 0 else None
                if have != expect:
                    raise Stale(f"session {session_id} is at event {have[0] if have else 0}, not "
                                f"{expect[0] if expect else 0}: it was appended to meanwhile")
            for session_id, _, evs in chains:
                if evs:
                    await self._insert(conn, session_id, evs)

    async def append_journal(self, session_id: str, expect_cursor: int, links: Sequence[Link],
                             new_cursor: int) -> list[EventRecord] | None:
        """The journal cursor's compare-and-set: if the stored cursor (none: 0) is still `expect_cursor`, append one
        event per link and set the cursor to `new_cursor`, in one transaction; the events written. None, with
        nothing written, if another puller moved the cursor first."""
        try:
            async with self.db.transaction() as conn:
                head = await self._lock_head(conn, session_id)
                stored = head.journal_cursor if head is not None else None
                if (stored or 0) != expect_cursor:
                    raise _Refused
                written = await self._link(conn, session_id, head, links)
                await conn.execute(self._cursor(session_id, new_cursor))
                return written
        except _Refused:
            return None

    async def start_fork(self, parent_session: str, parent_link: Link, child_session: str, child_link: Link,
                         child_cursor: int | None = None) -> tuple[EventRecord, EventRecord]:
        """Begin a fork child's chain in one transaction: the parent's next event (`parent_link`), the child's first
        (`child_link`, given no head) and, if given, the child's journal cursor. Conflict, with nothing written, if
        the child has an event already (a fork child is a new session). (parent's event, child's event)."""
        if parent_session == child_session:
            raise Conflict(f"session {child_session} cannot be forked from itself")
        async with self.db.transaction() as conn:
            locked = {s: await self._lock_head(conn, s) for s in sorted((parent_session, child_session))}
            child_head = locked[child_session]
            if child_head is not None and child_head.seq > 0:
                raise Conflict(f"session {child_session} already has a history; a fork child must be a new session")
            (parent_ev,) = await self._link(conn, parent_session, locked[parent_session], [parent_link])
            (child_ev,) = await self._link(conn, child_session, None, [child_link])
            if child_cursor is not None:
                await conn.execute(self._cursor(child_session, child_cursor))
        return parent_ev, child_ev

    # -- reading ----------------------------------------------------------------------------------------------------
    async def events(self, session_id: str, after: int = 0, limit: int | None = None) -> list[EventRecord]:
        """The session's events after seq `after`, in seq order, at most `limit`."""
        query = sa.select(events).where(_e.session_id == session_id, _e.seq > after).order_by(_e.seq)
        if limit is not None:
            query = query.limit(limit)
        async with self.db.read() as conn:
            return [record(EventRecord, r) for r in await conn.execute(query)]

    async def event(self, session_id: str, seq: int) -> EventRecord | None:
        async with self.db.read() as conn:
            row = (await conn.execute(sa.select(events).where(_e.session_id == session_id, _e.seq == seq))).first()
        return record(EventRecord, row) if row else None

    async def last_event(self, session_id: str) -> EventRecord | None:
        """The event the session's head names (one statement: the head and its event agree)."""
        query = sa.select(events).join(heads, sa.and_(_h.session_id == _e.session_id, _h.seq == _e.seq)) \
            .where(_h.session_id == session_id, _h.seq > 0)
        async with self.db.read() as conn:
            row = (await conn.execute(query)).first()
        return record(EventRecord, row) if row else None

    async def head(self, session_id: str) -> HeadRecord | None:
        """The session's head row as stored (seq 0: a journal cursor only), or None."""
        async with self.db.read() as conn:
            row = (await conn.execute(sa.select(heads).where(_h.session_id == session_id))).first()
        return record(HeadRecord, row) if row else None

    async def has_events(self, session_id: str) -> bool:
        head = await self.head(session_id)
        return head is not None and head.seq > 0

    async def chain(self, session_id: str) -> tuple[list[EventRecord], HeadRecord | None]:
        """Every event of the session and its head row, read by one statement (so in one snapshot on either
        database: PostgreSQL's READ COMMITTED gives each statement its own)."""
        null = sa.null()
        head_part = sa.select(sa.literal(0).label("part"), _h.seq, _h.hash, sa.cast(null, sa.Float).label("ts"),
                              sa.cast(null, sa.Text).label("kind"), sa.cast(null, sa.Text).label("data"),
                              sa.cast(null, sa.Text).label("prev"), _h.journal_cursor) \
            .where(_h.session_id == session_id)
        event_part = sa.select(sa.literal(1).label("part"), _e.seq, _e.hash, _e.ts, _e.kind, _e.data, _e.prev,
                               sa.cast(null, sa.BigInteger).label("journal_cursor")) \
            .where(_e.session_id == session_id)
        both = sa.union_all(head_part, event_part).subquery()
        async with self.db.read() as conn:
            rows = (await conn.execute(sa.select(both).order_by(both.c.part, both.c.seq))).all()
        head: HeadRecord | None = None
        out: list[EventRecord] = []
        for r in rows:
            if r.part == 0:
                head = HeadRecord(session_id=session_id, seq=int(r.seq), hash=r.hash, journal_cursor=r.journal_cursor)
            else:
                out.append(EventRecord(session_id=session_id, seq=int(r.seq), ts=float(r.ts), kind=r.kind,
                                       data=r.data, prev=r.prev, hash=r.hash))
        return out, head

    # -- journal cursor ---------------------------------------------------------------------------------------------
    async def journal_cursor(self, session_id: str) -> int | None:
        head = await self.head(session_id)
        return head.journal_cursor if head is not None else None

    async def set_journal_cursor(self, session_id: str, cursor: int) -> None:
        """Set where journal pulling continues, whatever it was (a resume or fork from a checkpoint)."""
        async with self.db.transaction() as conn:
            await conn.execute(self._cursor(session_id, cursor))

    # -- sessions ---------------------------------------------------------------------------------------------------
    async def put_session(self, rec: SessionRecord) -> None:
        """Insert the session, or update a recorded one: its state always; its template and parent links only where
        `rec` gives them (None keeps what is stored); its creation time never."""
        ins = _insert(self.db.kind, sessions).values(**columns(rec))
        keep = {name: sa.func.coalesce(ins.excluded[name], sessions.c[name])
                for name in ("template_id", "parent_session", "parent_checkpoint_id")}
        async with self.db.transaction() as conn:
            await conn.execute(ins.on_conflict_do_update(index_elements=["session_id"],
                                                         set_={"state": ins.excluded.state, **keep}))

    async def set_session_state(self, session_id: str, state: str) -> bool:
        """False if there is no such session."""
        async with self.db.transaction() as conn:
            done = await conn.execute(sessions.update().where(_s.session_id == session_id).values(state=state))
            return done.rowcount == 1

    async def session(self, session_id: str) -> SessionRecord | None:
        async with self.db.read() as conn:
            row = (await conn.execute(sa.select(sessions).where(_s.session_id == session_id))).first()
        return record(SessionRecord, row) if row else None

    async def template_spawns(self, template_id: str) -> tuple[int, float | None]:
        """(sessions started from the template, when the last one was), forks not counted."""
        query = sa.select(sa.func.count(), sa.func.max(_s.created)) \
            .where(_s.template_id == template_id, _s.parent_session.is_(None))
        async with self.db.read() as conn:
            row = (await conn.execute(query)).one()
        count, last = tuple(row)
        return int(count), (float(last) if last is not None else None)

    async def child_sessions(self, session_id: str) -> list[SessionRecord]:
        """The sessions forked from `session_id`, oldest first."""
        return await self._sessions(_s.parent_session == session_id)

    async def sessions_forked_from(self, checkpoint_id: str) -> list[SessionRecord]:
        return await self._sessions(_s.parent_checkpoint_id == checkpoint_id)

    # -- checkpoints ------------------------------------------------------------------------------------------------
    async def put_checkpoint(self, rec: CheckpointRecord) -> None:
        """Insert the checkpoint, or replace a recorded one's columns (its creation time is kept)."""
        values = columns(rec)
        async with self.db.transaction() as conn:
            await conn.execute(_upsert(self.db.kind, checkpoints, ["checkpoint_id"], values,
                                       set(values) - {"checkpoint_id", "created"}))

    async def checkpoint(self, checkpoint_id: str) -> CheckpointRecord | None:
        async with self.db.read() as conn:
            row = (await conn.execute(sa.select(checkpoints).where(_c.checkpoint_id == checkpoint_id))).first()
        return record(CheckpointRecord, row) if row else None

    async def checkpoints_of(self, session_id: str) -> list[CheckpointRecord]:
        """The session's checkpoints, oldest first (by creation time, then ID)."""
        query = sa.select(checkpoints).where(_c.session_id == session_id).order_by(_c.created, _c.checkpoint_id)
        async with self.db.read() as conn:
            return [record(CheckpointRecord, r) for r in await conn.execute(query)]

    async def delete_checkpoint(self, checkpoint_id: str) -> bool:
        async with self.db.transaction() as conn:
            done = await conn.execute(checkpoints.delete().where(_c.checkpoint_id == checkpoint_id))
            return done.rowcount == 1

    # -- inside a transaction ---------------------------------------------------------------------------------------
    async def _lock_head(self, conn: Conn, session_id: str) -> HeadRecord | None:
        """The session's head row, locked until the transaction ends (None: no row, and on SQLite none can appear
        meanwhile: the transaction holds the write lock)."""
        if self.db.kind == "postgresql":  # a row to lock, even for a session's first event
            await conn.execute(insert_or_ignore(self.db.kind, heads, ["session_id"],
                                                {"session_id": session_id, "seq": 0, "hash": NO_EVENT_HASH}))
        row = (await conn.execute(sa.select(heads).where(_h.session_id == session_id).with_for_update())).first()
        await self._check_fence(conn, session_id)
        return record(HeadRecord, row) if row else None

    async def _check_fence(self, conn: Conn, session_id: str) -> None:
        claim = self.fence(session_id) if self.fence is not None else None
        if claim is None:
            return
        sandbox_id, node_id, epoch = claim
        query = sa.select(sandboxes.c.node_id, sandboxes.c.epoch).where(sandboxes.c.sandbox_id == sandbox_id)
        if self.db.kind == "postgresql":
            query = query.with_for_update(read=True)
        row = (await conn.execute(query)).first()
        if row is not None and (row.node_id, row.epoch) != (node_id, epoch):
            raise Fenced(f"session {session_id}: sandbox {sandbox_id} is node {row.node_id}'s at epoch {row.epoch}, "
                         f"not {node_id}'s at {epoch}: its history is not this writer's to extend")

    async def _link(self, conn: Conn, session_id: str, head: HeadRecord | None,
                    links: Sequence[Link]) -> list[EventRecord]:
        """Build each event from the head before it, then write them and the new head."""
        out: list[EventRecord] = []
        at = head if head is not None and head.seq > 0 else None
        for link in links:
            ev = link(at)
            _continues(session_id, (at.seq, at.hash) if at is not None else None, [ev])
            out.append(ev)
            at = HeadRecord(session_id=session_id, seq=ev.seq, hash=ev.hash)
        if out:
            await self._insert(conn, session_id, out)
        return out

    async def _insert(self, conn: Conn, session_id: str, evs: Sequence[EventRecord]) -> None:
        await conn.execute(events.insert(), [columns(ev) for ev in evs])
        last = evs[-1]
        await conn.execute(_upsert(self.db.kind, heads, ["session_id"],
                                   {"session_id": session_id, "seq": last.seq, "hash": last.hash}, {"seq", "hash"}))

    def _cursor(self, session_id: str, cursor: int) -> sa.Insert:
        """Set the session's journal cursor, making its head row (at seq 0) if it has none."""
        values = {"session_id": session_id, "seq": 0, "hash": NO_EVENT_HASH, "journal_cursor": cursor}
        return _upsert(self.db.kind, heads, ["session_id"], values, {"journal_cursor"})

    async def _sessions(self, where: sa.ColumnElement[bool]) -> list[SessionRecord]:
        async with self.db.read() as conn:
            rows = await conn.execute(sa.select(sessions).where(where).order_by(_s.created, _s.session_id))
            return [record(SessionRecord, r) for r in rows]


def _continues(session_id: str, expect: tuple[int, str] | None, evs: Sequence[EventRecord]) -> None:
    """ValueError unless `evs` are the session's, seq by seq after `expect`, each linked to the one before."""
    seq, prev = expect if expect is not None else (0, None)
    for ev in evs:
        if ev.session_id != session_id:
            raise ValueError(f"event {ev.seq} names session {ev.session_id}, not {session_id}")
        if ev.seq != seq + 1 or (prev is not None and ev.prev != prev):
            raise ValueError(f"session {session_id}: event {ev.seq} does not continue the head {seq}")
        seq, prev = ev.seq, ev.hash


def _insert(kind: str, table: sa.Table) -> postgresql.Insert | sqlite_dialect.Insert:
    return postgresql.insert(table) if kind == "postgresql" else sqlite_dialect.insert(table)


def _upsert(kind: str, table: sa.Table, key: list[str], values: dict[str, object],
            update: set[str]) -> sa.Insert:
    """INSERT `values` … ON CONFLICT (key) DO UPDATE SET only the columns of `update`."""
    ins = _insert(kind, table).values(**values)
    return ins.on_conflict_do_update(index_elements=key, set_={name: ins.excluded[name] for name in update})
