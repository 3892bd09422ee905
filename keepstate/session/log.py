"""The event log: append, read, verify, fork, export and import sessions' hash-chained histories."""

from __future__ import annotations

import sqlite3
from collections import OrderedDict
from pathlib import Path
from typing import Any

from keepstate.errors import BadRequest, Conflict, NotFound
from keepstate.store.manifest import EventRef

from .chain import VerifyResult, verify_chain, verify_events
from .db import SessionDB
from .event import Event, canonical

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


class EventLog:
    """Sessions' causal histories in `sessions.sqlite` (see docs/design/causal-history.md).

    Thread-safe; several processes may open the same file.
    """

    def __init__(self, path: Path | SessionDB) -> None:
        self.db = path if isinstance(path, SessionDB) else SessionDB(path)

    def close(self) -> None:
        self.db.close()

    # --- writing --------------------------------------------------------------------------------------------------

    def append(self, session_id: str, kind: str, data: dict[str, Any] | None = None) -> Event:
        data = {} if data is None else data
        _check(kind, data)
        return self.db.append_events([(session_id, kind, data)])[0]

    def start_fork(self, child_session: str, parent_session: str, parent_checkpoint_id: str,
                   parent_event: EventRef) -> Event:
        """Begin a fork child's history with a link to the parent's checkpoint event.

        In one transaction: `fork.child` in the parent and `session.fork` (seq 1) in the child; the child's journal
        cursor starts at the checkpoint's. Returns the child's first event.
        """
        parent = self.db.event_at(parent_session, parent_event.seq)
        if parent is None:
            raise NotFound(f"session {parent_session} has no event {parent_event.seq} to fork from")
        if parent.hash != parent_event.hash:
            raise Conflict(f"session {parent_session} event {parent_event.seq} has hash {parent.hash[:12]}…, "
                           f"not {parent_event.hash[:12]}…: the fork names a different history")
        cursor = parent.data.get("journal_cursor") if parent.kind == "checkpoint" else None

        def child_is_new(db: sqlite3.Connection) -> bool:
            return db.execute("SELECT 1 FROM events WHERE session_id=?", (child_session,)).fetchone() is None

        def set_cursor(db: sqlite3.Connection) -> None:
            if isinstance(cursor, int):
                SessionDB.write_cursor(db, child_session, cursor)

        link = {"parent_session": parent_session, "parent_checkpoint_id": parent_checkpoint_id,
                "parent_event": {"seq": parent_event.seq, "hash": parent_event.hash}}
        events = self.db.append_events(
            [(parent_session, "fork.child", {"child_session": child_session, "checkpoint_id": parent_checkpoint_id}),
             (child_session, "session.fork", link)], precondition=child_is_new, after=set_cursor)
        if not events:
            raise Conflict(f"session {child_session} already has a history; a fork child must be a new session")
        return events[1]

    # --- reading --------------------------------------------------------------------------------------------------

    def read(self, session_id: str, after: int = 0, limit: int | None = None) -> list[Event]:
        if after < 0 or (limit is not None and limit < 0):
            raise BadRequest("after and limit must not be negative")
        return self.db.read_events(session_id, after, limit)

    def head(self, session_id: str) -> Event | None:
        head = self.db.head(session_id)
        return None if head is None else self.db.event_at(session_id, head[0])

    def exists(self, session_id: str) -> bool:
        return self.db.has_events(session_id)

    def checkpoint_event(self, session_id: str, checkpoint_id: str) -> Event | None:
        """The `checkpoint` event recorded for `checkpoint_id` in the session, if any."""
        for ev in self.read(session_id):
            if ev.kind == "checkpoint" and ev.data.get("checkpoint_id") == checkpoint_id:
                return ev
        return None

    def causal_history(self, session_id: str) -> list[Event]:
        """The session's events preceded, for a fork, by its ancestors' events up to the forked-from event."""
        own = self.read(session_id)
        if not own and not self.exists(session_id):
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
            prefix = self.read(parent, limit=upto)
            chains.append(prefix)
            first = prefix[0] if prefix else None
        return [ev for chain in reversed(chains) for ev in chain]

    # --- verification ---------------------------------------------------------------------------------------------

    def verify(self, session_id: str) -> VerifyResult:
        """Recompute every hash and link of the session's chain, its recorded head and, for a fork, its link."""
        rows, head = self.db.read_stored(session_id)
        if not rows and head is None:
            raise NotFound(f"no events for session {session_id}")
        result = verify_chain(session_id, rows, head)
        if not result.ok or not rows or rows[0].kind != "session.fork":
            return result
        first = self.db.read_events(session_id, 0, 1)[0]
        ref = first.data.get("parent_event") or {}
        parent_session = str(first.data.get("parent_session"))
        if not self.db.has_events(parent_session):
            return result  # parent history not on this server (an import): the link cannot be checked here
        parent = self.db.event_at(parent_session, int(ref.get("seq", 0)))
        if parent is None or parent.hash != ref.get("hash"):
            return VerifyResult(False, result.checked, 1,
                                f"event 1: fork link names event {ref.get('seq')} of session {parent_session}, "
                                "which does not exist with that hash")
        return result

    # --- journal cursor -------------------------------------------------------------------------------------------

    def journal_cursor(self, session_id: str) -> int | None:
        return self.db.journal_cursor(session_id)

    def set_journal_cursor(self, session_id: str, cursor: int) -> None:
        """Reset where journal pulling continues (on resume or fork from a checkpoint: its journal_cursor)."""
        if cursor < 0:
            raise BadRequest("journal cursor must not be negative")
        self.db.set_journal_cursor(session_id, cursor)

    def append_journal(self, session_id: str, expected_cursor: int, items: list[tuple[str, dict[str, Any]]],
                       new_cursor: int) -> list[Event] | None:
        """Append pulled journal entries and move the cursor, only if the stored cursor is still `expected_cursor`.

        Returns None (and writes nothing) when another puller moved the cursor first.
        """
        for kind, data in items:
            _check(kind, data)

        def unchanged(db: sqlite3.Connection) -> bool:
            stored = SessionDB.stored_cursor(db, session_id)
            return (stored or 0) == expected_cursor

        moved = [False]

        def move(db: sqlite3.Connection) -> None:
            SessionDB.write_cursor(db, session_id, new_cursor)
            moved[0] = True

        events = self.db.append_events([(session_id, k, d) for k, d in items], precondition=unchanged,
                                       after=move)
        return events if moved[0] else None

    # --- export and import ----------------------------------------------------------------------------------------

    def export(self, session_id: str) -> list[dict[str, Any]]:
        """The causal history as plain event objects, ancestors first (travels with an exported checkpoint)."""
        return [ev.to_dict() for ev in self.causal_history(session_id)]

    def import_(self, events: list[dict[str, Any]]) -> dict[str, int]:
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
        to_write: list[Event] = []
        added: dict[str, int] = {}
        for sid, chain in by_session.items():
            chain.sort(key=lambda e: e.seq)
            result = verify_events(sid, chain)
            if not result.ok:
                raise BadRequest(f"imported history of session {sid} does not verify: {result.reason}")
            local = self.read(sid)
            for mine, theirs in zip(local, chain, strict=False):  # the shared prefix
                if mine.hash != theirs.hash:
                    raise Conflict(f"session {sid} already has a different event {mine.seq} on this server")
            new = chain[len(local):]
            to_write.extend(new)
            added[sid] = len(new)
        if to_write:
            try:
                self.db.insert_chain(to_write)
            except ValueError as exc:
                raise Conflict(f"import raced with a local append: {exc}") from None
        return added
