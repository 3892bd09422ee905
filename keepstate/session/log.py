"""The event log: append, read, verify, fork, export and import sessions' hash-chained histories.

The rows live in the database (keepstate.db.repos.History); the chain (each event's hash and its link to the one
before) is made here, by pure functions the repository calls inside its write transaction with the session's head.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from keepstate.db.engine import Database
from keepstate.db.errors import Stale
from keepstate.db.records import EventRecord, HeadRecord
from keepstate.db.repos.history import History
from keepstate.errors import BadRequest, Conflict, NotFound
from keepstate.store.manifest import EventRef

from .chain import StoredEvent, VerifyResult, verify_chain, verify_events
from .event import GENESIS, Event, canonical

MAX_DATA_BYTES = 1 << 20


def _check(kind: str, data: dict[str, Any]) -> None:
    if not isinstance(kind, str) or not kind:
        raise BadRequest("event kind must be a non-empty string")
    if not isinstance(data, dict):
        raise BadRequest(f"event data must be a JSON object, got {type(data).__name__}")
    try:
        size = len(canonical(data))
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"event data of kind {kind!r} is not JSON-encodable: {exc}") from None
    if size > MAX_DATA_BYTES:
        raise BadRequest(f"event data of kind {kind!r} is {size} bytes; the limit is {MAX_DATA_BYTES}")


def to_record(ev: Event) -> EventRecord:
    return EventRecord(session_id=ev.session_id, seq=ev.seq, ts=ev.ts, kind=ev.kind, data=canonical(ev.data).decode(),
                       prev=ev.prev, hash=ev.hash)


def from_record(rec: EventRecord) -> Event:
    return Event(rec.session_id, rec.seq, rec.ts, rec.kind, json.loads(rec.data), rec.prev, rec.hash)


def _stored(rec: EventRecord) -> StoredEvent:
    return StoredEvent(rec.session_id, rec.seq, rec.ts, rec.kind, rec.data, rec.prev, rec.hash)


def link(session_id: str, kind: str, data: dict[str, Any], ts: float) -> Callable[[HeadRecord | None], EventRecord]:
    """The repository's Link: the event after the session's head (GENESIS before its first). Pure."""

    def make(head: HeadRecord | None) -> EventRecord:
        seq, prev = (head.seq, head.hash) if head is not None else (0, GENESIS)
        return to_record(Event.make(session_id, seq + 1, ts, kind, data, prev))

    return make


class EventLog:
    """Sessions' causal histories (see docs/design/causal-history.md), in the server's one database.

    Every method that touches the database is async; any number of servers and processes may share it.
    """

    def __init__(self, db: Database | History) -> None:
        self.history = db if isinstance(db, History) else History(db)

    # --- writing --------------------------------------------------------------------------------------------------

    async def append(self, session_id: str, kind: str, data: dict[str, Any] | None = None) -> Event:
        data = {} if data is None else data
        _check(kind, data)
        (rec,) = await self.history.extend(session_id, [link(session_id, kind, data, time.time())])
        return from_record(rec)

    async def start_fork(self, child_session: str, parent_session: str, parent_checkpoint_id: str,
                         parent_event: EventRef) -> Event:
        """Begin a fork child's history with a link to the parent's checkpoint event.

        In one transaction: `fork.child` in the parent and `session.fork` (seq 1) in the child; the child's journal
        cursor starts at the checkpoint's. Returns the child's first event.
        """
        parent = await self.event_at(parent_session, parent_event.seq)
        if parent is None:
            raise NotFound(f"session {parent_session} has no event {parent_event.seq} to fork from")
        if parent.hash != parent_event.hash:
            raise Conflict(f"session {parent_session} event {parent_event.seq} has hash {parent.hash[:12]}…, "
                           f"not {parent_event.hash[:12]}…: the fork names a different history")
        cursor = parent.data.get("journal_cursor") if parent.kind == "checkpoint" else None
        now = time.time()
        link_data = {"parent_session": parent_session, "parent_checkpoint_id": parent_checkpoint_id,
                     "parent_event": {"seq": parent_event.seq, "hash": parent_event.hash}}
        _, first = await self.history.start_fork(
            parent_session, link(parent_session, "fork.child",
                                 {"child_session": child_session, "checkpoint_id": parent_checkpoint_id}, now),
            child_session, link(child_session, "session.fork", link_data, now),
            child_cursor=cursor if isinstance(cursor, int) and not isinstance(cursor, bool) else None)
        return from_record(first)

    # --- reading --------------------------------------------------------------------------------------------------

    async def read(self, session_id: str, after: int = 0, limit: int | None = None) -> list[Event]:
        if after < 0 or (limit is not None and limit < 0):
            raise BadRequest("after and limit must not be negative")
        return [from_record(r) for r in await self.history.events(session_id, after, limit)]

    async def head(self, session_id: str) -> Event | None:
        rec = await self.history.last_event(session_id)
        return None if rec is None else from_record(rec)

    async def event_at(self, session_id: str, seq: int) -> Event | None:
        rec = await self.history.event(session_id, seq)
        return None if rec is None else from_record(rec)

    async def exists(self, session_id: str) -> bool:
        return await self.history.has_events(session_id)

    async def checkpoint_event(self, session_id: str, checkpoint_id: str) -> Event | None:
        """The `checkpoint` event recorded for `checkpoint_id` in the session, if any."""
        for ev in await self.read(session_id):
            if ev.kind == "checkpoint" and ev.data.get("checkpoint_id") == checkpoint_id:
                return ev
        return None

    async def causal_history(self, session_id: str) -> list[Event]:
        """The session's events preceded, for a fork, by its ancestors' events up to the forked-from event."""
        own = await self.read(session_id)
        if not own and not await self.exists(session_id):
            raise NotFound(f"no events for session {session_id}")
        chains: list[list[Event]] = [own]
        seen = {session_id}
        first = own[0] if own else None
        while first is not None and first.kind == "session.fork":
            parent = str(first.data.get("parent_session"))
            upto = int(first.data.get("parent_event", {}).get("seq", 0))
            if parent in seen:
                break  # a cycle can only come from a forged import; stop rather than loop
            seen.add(parent)
            prefix = await self.read(parent, limit=upto)
            chains.append(prefix)
            first = prefix[0] if prefix else None
        return [ev for chain in reversed(chains) for ev in chain]

    # --- verification ---------------------------------------------------------------------------------------------

    async def verify(self, session_id: str) -> VerifyResult:
        """Recompute every hash and link of the session's chain, its recorded head and, for a fork, its link."""
        records, head_row = await self.history.chain(session_id)
        if not records and head_row is None:
            raise NotFound(f"no events for session {session_id}")
        rows = [_stored(r) for r in records]
        head = (head_row.seq, head_row.hash) if head_row is not None else None
        result = verify_chain(session_id, rows, head)
        if not result.ok or not rows or rows[0].kind != "session.fork":
            return result
        first = from_record(records[0])
        ref = first.data.get("parent_event") or {}
        parent_session = str(first.data.get("parent_session"))
        if not await self.exists(parent_session):
            return result  # parent history not on this server (an import): the link cannot be checked here
        parent = await self.event_at(parent_session, int(ref.get("seq", 0)))
        if parent is None or parent.hash != ref.get("hash"):
            return VerifyResult(False, result.checked, 1,
                                f"event 1: fork link names event {ref.get('seq')} of session {parent_session}, "
                                "which does not exist with that hash")
        return result

    # --- journal cursor -------------------------------------------------------------------------------------------

    async def journal_cursor(self, session_id: str) -> int | None:
        return await self.history.journal_cursor(session_id)

    async def set_journal_cursor(self, session_id: str, cursor: int) -> None:
        """Reset where journal pulling continues (on resume or fork from a checkpoint: its journal_cursor)."""
        if cursor < 0:
            raise BadRequest("journal cursor must not be negative")
        await self.history.set_journal_cursor(session_id, cursor)

    async def append_journal(self, session_id: str, expected_cursor: int, items: list[tuple[str, dict[str, Any]]],
                             new_cursor: int) -> list[Event] | None:
        """Append pulled journal entries and move the cursor, only if the stored cursor is still `expected_cursor`.

        Returns None (and writes nothing) when another puller moved the cursor first.
        """
        for kind, data in items:
            _check(kind, data)
        now = time.time()
        written = await self.history.append_journal(
            session_id, expected_cursor, [link(session_id, k, d, now) for k, d in items], new_cursor)
        return None if written is None else [from_record(r) for r in written]

    # --- export and import ----------------------------------------------------------------------------------------

    async def export(self, session_id: str) -> list[dict[str, Any]]:
        """The causal history as plain event objects, ancestors first (travels with an exported checkpoint)."""
        return [ev.to_dict() for ev in await self.causal_history(session_id)]

    async def import_(self, events: list[dict[str, Any]]) -> dict[str, int]:
        """Import exported events; returns {session_id: events added}. All chains are verified before any write.

        A session already here is extended when its chain is a prefix of the imported one; a chain that differs
        raises Conflict.
        """
        by_session: OrderedDict[str, list[Event]] = OrderedDict()
        for i, raw in enumerate(events):
            try:
                ev = Event.from_dict(raw)
            except ValueError as exc:
                raise BadRequest(f"imported event #{i}: {exc}") from None
            by_session.setdefault(ev.session_id, []).append(ev)
        to_write: list[tuple[str, tuple[int, str] | None, list[EventRecord]]] = []
        added: dict[str, int] = {}
        for sid, chain in by_session.items():
            chain.sort(key=lambda e: e.seq)
            result = verify_events(sid, chain)
            if not result.ok:
                raise BadRequest(f"imported history of session {sid} does not verify: {result.reason}")
            local = await self.read(sid)
            for mine, theirs in zip(local, chain, strict=False):  # the shared prefix
                if mine.hash != theirs.hash:
                    raise Conflict(f"session {sid} already has a different event {mine.seq} on this server")
            new = chain[len(local):]
            if new:
                to_write.append((sid, (local[-1].seq, local[-1].hash) if local else None,
                                 [to_record(e) for e in new]))
            added[sid] = len(new)
        if to_write:
            try:
                await self.history.append_chains(to_write)
            except (Stale, ValueError) as exc:
                raise Conflict(f"import raced with a local append: {exc}") from None
        return added
