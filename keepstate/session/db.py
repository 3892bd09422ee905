"""The sessions database: the only module that speaks SQL (SQLite in WAL mode today, PostgreSQL later).

Several processes share the file (the server, `keepstate events`); anything that must hold across them (seq and
prev of an append, the journal cursor) is read and written in one `BEGIN IMMEDIATE` transaction.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .chain import StoredEvent
from .event import GENESIS, Event, canonical

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
  session_id TEXT NOT NULL, seq INTEGER NOT NULL, ts REAL NOT NULL, kind TEXT NOT NULL, data TEXT NOT NULL,
  prev TEXT NOT NULL, hash TEXT NOT NULL, PRIMARY KEY (session_id, seq));
CREATE TABLE IF NOT EXISTS heads (
  session_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, hash TEXT NOT NULL, journal_cursor INTEGER);
CREATE TABLE IF NOT EXISTS sessions (
  session_id TEXT PRIMARY KEY, template_id TEXT, created REAL NOT NULL, parent_session TEXT,
  parent_checkpoint_id TEXT, state TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS sessions_parent ON sessions(parent_session);
CREATE INDEX IF NOT EXISTS sessions_template ON sessions(template_id);
CREATE TABLE IF NOT EXISTS checkpoints (
  checkpoint_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, parent_checkpoint_id TEXT, kind TEXT NOT NULL,
  event_seq INTEGER, event_hash TEXT, journal_cursor INTEGER, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS checkpoints_session ON checkpoints(session_id, created);
"""


class SchemaMismatch(RuntimeError):
    pass


@dataclass(frozen=True)
class SessionRow:
    session_id: str
    template_id: str | None
    created: float
    parent_session: str | None
    parent_checkpoint_id: str | None
    state: str


@dataclass(frozen=True)
class CheckpointRow:
    checkpoint_id: str
    session_id: str
    parent_checkpoint_id: str | None
    kind: str
    event_seq: int | None
    event_hash: str | None
    journal_cursor: int | None
    created: float


class SessionDB:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.RLock()  # one connection, many threads: transactions must not interleave
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
        self.db.execute("PRAGMA busy_timeout=30000")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        with self.tx() as db:
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    db.execute(stmt)
            row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) != SCHEMA_VERSION:
                raise SchemaMismatch(f"{path}: schema version {row[0]}, this keepstate reads {SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self.db.close()

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self.db.execute(sql, args).fetchall()

    # --- events ---------------------------------------------------------------------------------------------------

    @staticmethod
    def _head(db: sqlite3.Connection, session_id: str) -> tuple[int, str]:
        row = db.execute("SELECT seq, hash FROM heads WHERE session_id=?", (session_id,)).fetchone()
        return (int(row[0]), str(row[1])) if row else (0, GENESIS)

    @staticmethod
    def _insert(db: sqlite3.Connection, ev: Event) -> None:
        db.execute("INSERT INTO events VALUES (?,?,?,?,?,?,?)",
                   (ev.session_id, ev.seq, ev.ts, ev.kind, canonical(ev.data).decode(), ev.prev, ev.hash))
        db.execute("INSERT INTO heads (session_id, seq, hash) VALUES (?,?,?) ON CONFLICT(session_id) DO UPDATE "
                   "SET seq=excluded.seq, hash=excluded.hash", (ev.session_id, ev.seq, ev.hash))

    def append_events(self, items: list[tuple[str, str, dict[str, Any]]], ts: float | None = None,
                      precondition: Callable[[sqlite3.Connection], bool] | None = None,
                      after: Callable[[sqlite3.Connection], None] | None = None) -> list[Event]:
        """Append (session_id, kind, data) items in one transaction, each linked to its session's head.

        `precondition` runs first inside the transaction; if it returns False nothing is written. `after` runs
        last inside it (e.g. to move the journal cursor with the events).
        """
        now = time.time() if ts is None else ts
        out: list[Event] = []
        with self.tx() as db:
            if precondition is not None and not precondition(db):
                return []
            for session_id, kind, data in items:
                seq, prev = self._head(db, session_id)
                ev = Event.make(session_id, seq + 1, now, kind, data, prev)
                self._insert(db, ev)
                out.append(ev)
            if after is not None:
                after(db)
        return out

    def insert_chain(self, events: list[Event]) -> None:
        """Write already-hashed events (an import); each must continue its session's current head."""
        with self.tx() as db:
            for ev in events:
                seq, prev = self._head(db, ev.session_id)
                if ev.seq != seq + 1 or ev.prev != prev:
                    raise ValueError(f"session {ev.session_id}: event {ev.seq} does not continue the head {seq}")
                self._insert(db, ev)

    def read_events(self, session_id: str, after: int = 0, limit: int | None = None) -> list[Event]:
        rows = self._read("SELECT session_id, seq, ts, kind, data, prev, hash FROM events WHERE session_id=? AND seq>? "
                          "ORDER BY seq LIMIT ?", (session_id, after, -1 if limit is None else limit))
        return [Event(r[0], int(r[1]), float(r[2]), r[3], json.loads(r[4]), r[5], r[6]) for r in rows]

    def read_stored(self, session_id: str) -> tuple[list[StoredEvent], tuple[int, str] | None]:
        """The raw rows and the recorded head, read in one snapshot."""
        with self.tx() as db:
            rows = db.execute("SELECT session_id, seq, ts, kind, data, prev, hash FROM events WHERE session_id=? "
                              "ORDER BY seq", (session_id,)).fetchall()
            head = db.execute("SELECT seq, hash FROM heads WHERE session_id=?", (session_id,)).fetchone()
        return ([StoredEvent(r[0], r[1], r[2], r[3], r[4], r[5], r[6]) for r in rows],
                (int(head[0]), str(head[1])) if head else None)

    def head(self, session_id: str) -> tuple[int, str] | None:
        rows = self._read("SELECT seq, hash FROM heads WHERE session_id=? AND seq>0", (session_id,))
        return (int(rows[0][0]), str(rows[0][1])) if rows else None

    def event_at(self, session_id: str, seq: int) -> Event | None:
        found = self.read_events(session_id, after=seq - 1, limit=1)
        return found[0] if found and found[0].seq == seq else None

    def has_events(self, session_id: str) -> bool:
        return bool(self._read("SELECT 1 FROM heads WHERE session_id=? AND seq>0", (session_id,)))

    def journal_cursor(self, session_id: str) -> int | None:
        rows = self._read("SELECT journal_cursor FROM heads WHERE session_id=?", (session_id,))
        return None if not rows or rows[0][0] is None else int(rows[0][0])

    @staticmethod
    def stored_cursor(db: sqlite3.Connection, session_id: str) -> int | None:
        row = db.execute("SELECT journal_cursor FROM heads WHERE session_id=?", (session_id,)).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    @staticmethod
    def write_cursor(db: sqlite3.Connection, session_id: str, cursor: int) -> None:
        db.execute("INSERT INTO heads (session_id, seq, hash, journal_cursor) VALUES (?,0,?,?) "
                   "ON CONFLICT(session_id) DO UPDATE SET journal_cursor=excluded.journal_cursor",
                   (session_id, GENESIS, cursor))

    def set_journal_cursor(self, session_id: str, cursor: int) -> None:
        with self.tx() as db:
            self.write_cursor(db, session_id, cursor)

    # --- lineage --------------------------------------------------------------------------------------------------

    def upsert_session(self, row: SessionRow) -> None:
        with self.tx() as db:
            db.execute("INSERT INTO sessions VALUES (?,?,?,?,?,?) ON CONFLICT(session_id) DO UPDATE SET "
                       "template_id=COALESCE(excluded.template_id, template_id), state=excluded.state, "
                       "parent_session=COALESCE(excluded.parent_session, parent_session), "
                       "parent_checkpoint_id=COALESCE(excluded.parent_checkpoint_id, parent_checkpoint_id)",
                       (row.session_id, row.template_id, row.created, row.parent_session, row.parent_checkpoint_id,
                        row.state))

    def set_session_state(self, session_id: str, state: str) -> bool:
        with self.tx() as db:
            return db.execute("UPDATE sessions SET state=? WHERE session_id=?", (state, session_id)).rowcount > 0

    def session(self, session_id: str) -> SessionRow | None:
        rows = self._read("SELECT * FROM sessions WHERE session_id=?", (session_id,))
        return SessionRow(*rows[0]) if rows else None

    def template_spawns(self, template_id: str) -> tuple[int, float | None]:
        """(sessions started from the template, when the last one was), forks not counted."""
        rows = self._read("SELECT COUNT(*), MAX(created) FROM sessions WHERE template_id=? AND parent_session IS NULL",
                          (template_id,))
        return (int(rows[0][0]), rows[0][1]) if rows else (0, None)

    def child_sessions(self, session_id: str) -> list[SessionRow]:
        rows = self._read("SELECT * FROM sessions WHERE parent_session=? ORDER BY created, session_id", (session_id,))
        return [SessionRow(*r) for r in rows]

    def sessions_forked_from(self, checkpoint_id: str) -> list[SessionRow]:
        rows = self._read("SELECT * FROM sessions WHERE parent_checkpoint_id=? ORDER BY created, session_id",
                          (checkpoint_id,))
        return [SessionRow(*r) for r in rows]

    def insert_checkpoint(self, row: CheckpointRow) -> None:
        with self.tx() as db:
            db.execute("INSERT INTO checkpoints VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(checkpoint_id) DO UPDATE SET "
                       "session_id=excluded.session_id, parent_checkpoint_id=excluded.parent_checkpoint_id, "
                       "kind=excluded.kind, event_seq=excluded.event_seq, event_hash=excluded.event_hash, "
                       "journal_cursor=excluded.journal_cursor",
                       (row.checkpoint_id, row.session_id, row.parent_checkpoint_id, row.kind, row.event_seq,
                        row.event_hash, row.journal_cursor, row.created))

    def checkpoint(self, checkpoint_id: str) -> CheckpointRow | None:
        rows = self._read("SELECT * FROM checkpoints WHERE checkpoint_id=?", (checkpoint_id,))
        return CheckpointRow(*rows[0]) if rows else None

    def checkpoints_of(self, session_id: str) -> list[CheckpointRow]:
        rows = self._read("SELECT * FROM checkpoints WHERE session_id=? ORDER BY created, rowid", (session_id,))
        return [CheckpointRow(*r) for r in rows]

    def delete_checkpoint(self, checkpoint_id: str) -> bool:
        with self.tx() as db:
            return db.execute("DELETE FROM checkpoints WHERE checkpoint_id=?", (checkpoint_id,)).rowcount > 0
