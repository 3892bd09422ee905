"""The gateway's data-access module: the only place that speaks SQL (SQLite in WAL mode today).

Several processes may share the file (the server with the gateway mounted, a standalone `keepstate gateway`, the
`keepstate ledger` command); anything that must hold across them (budgets, run tokens) is done in one
`BEGIN IMMEDIATE` transaction.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keepstate import pids
from keepstate.gateway.usage import Usage

SCHEMA_VERSION = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
  run_id TEXT PRIMARY KEY, token_hash TEXT UNIQUE NOT NULL, session_id TEXT NOT NULL, sandbox_id TEXT NOT NULL,
  api_key_id TEXT, checkpoint_id TEXT, mode TEXT NOT NULL, parent_session_id TEXT,
  created_at REAL NOT NULL, ended_at REAL, aligned_at INTEGER, source_ip TEXT);
CREATE INDEX IF NOT EXISTS runs_session ON runs(session_id, created_at);
CREATE TABLE IF NOT EXISTS marks (
  checkpoint_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, run_id TEXT NOT NULL, position INTEGER NOT NULL,
  created_at REAL NOT NULL, last_position INTEGER);
CREATE TABLE IF NOT EXISTS positions (
  run_id TEXT NOT NULL, ordinal INTEGER NOT NULL, call_key TEXT NOT NULL, body_hash TEXT NOT NULL,
  source TEXT NOT NULL, delivered INTEGER NOT NULL DEFAULT 0, arrived_at REAL, delivered_at REAL,
  PRIMARY KEY (run_id, ordinal));
CREATE INDEX IF NOT EXISTS positions_hash ON positions(run_id, body_hash, ordinal);
CREATE TABLE IF NOT EXISTS calls (
  call_key TEXT PRIMARY KEY, session_id TEXT NOT NULL, run_id TEXT NOT NULL, endpoint TEXT NOT NULL,
  provider TEXT NOT NULL, model TEXT NOT NULL, stream INTEGER NOT NULL, body_hash TEXT NOT NULL,
  status TEXT NOT NULL, http_status INTEGER, content_type TEXT, response BLOB, usage TEXT,
  upstream_request_id TEXT, owner TEXT, attempts INTEGER NOT NULL DEFAULT 0, ok_entry_id INTEGER,
  created_at REAL NOT NULL, finished_at REAL);
CREATE INDEX IF NOT EXISTS calls_status ON calls(status);
CREATE TABLE IF NOT EXISTS ledger (
  entry_id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, outcome TEXT NOT NULL, call_key TEXT NOT NULL,
  session_id TEXT NOT NULL, sandbox_id TEXT NOT NULL, api_key_id TEXT, run_id TEXT NOT NULL,
  provider TEXT NOT NULL, model TEXT NOT NULL, endpoint TEXT NOT NULL, http_status INTEGER,
  input_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0,
  cached_tokens INTEGER NOT NULL DEFAULT 0, cache_write_tokens INTEGER NOT NULL DEFAULT 0,
  reasoning_tokens INTEGER NOT NULL DEFAULT 0, cost_nano INTEGER NOT NULL DEFAULT 0, priced INTEGER NOT NULL,
  upstream_request_id TEXT, original_entry_id INTEGER, started_at REAL NOT NULL, finished_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS ledger_session ON ledger(session_id, entry_id);
CREATE INDEX IF NOT EXISTS ledger_call ON ledger(call_key);
CREATE TABLE IF NOT EXISTS divergences (
  id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, ordinal INTEGER NOT NULL,
  expected_call_key TEXT NOT NULL, expected_hash TEXT NOT NULL, got_hash TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS budgets (
  scope TEXT NOT NULL, ident TEXT NOT NULL, limit_nano INTEGER NOT NULL, spent_nano INTEGER NOT NULL DEFAULT 0,
  reserved_nano INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (scope, ident));
CREATE TABLE IF NOT EXISTS reservations (
  id INTEGER PRIMARY KEY AUTOINCREMENT, call_key TEXT NOT NULL, owner TEXT NOT NULL, scope TEXT NOT NULL,
  ident TEXT NOT NULL, amount_nano INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS reservations_call ON reservations(call_key);
CREATE TABLE IF NOT EXISTS bindings (
  source_ip TEXT PRIMARY KEY, run_id TEXT NOT NULL, created_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS bindings_run ON bindings(run_id);
"""


# What turns a version 1 file into a version 2 one; the `bindings` table itself comes from _SCHEMA.
_MIGRATE_1_TO_2 = (
    "ALTER TABLE runs ADD COLUMN aligned_at INTEGER",
    "ALTER TABLE runs ADD COLUMN source_ip TEXT",
    "ALTER TABLE marks ADD COLUMN last_position INTEGER",
    "ALTER TABLE positions ADD COLUMN arrived_at REAL",
    "ALTER TABLE positions ADD COLUMN delivered_at REAL",
)


class StoreError(RuntimeError):
    pass


class BudgetRefused(Exception):
    def __init__(self, scope: str, ident: str) -> None:
        super().__init__(f"{scope} {ident}")
        self.scope, self.ident = scope, ident


@dataclass(frozen=True, slots=True)
class Run:
    run_id: str
    session_id: str
    sandbox_id: str
    api_key_id: str | None
    checkpoint_id: str | None
    mode: str
    parent_session_id: str | None
    ended: bool
    aligned_at: int | None = None  # for a run from a marked checkpoint: the source run's position of ordinal 0
    source_ip: str | None = None  # the address its sandbox instance was registered with


@dataclass(frozen=True, slots=True)
class Position:
    run_id: str
    ordinal: int
    call_key: str
    body_hash: str
    source: str
    delivered: bool
    arrived_at: float | None = None
    delivered_at: float | None = None


@dataclass(frozen=True, slots=True)
class Mark:
    checkpoint_id: str
    session_id: str
    run_id: str
    position: int  # the lowest position the restored agent can re-issue first
    last_position: int | None = None  # the highest (None: exactly `position`); see docs/design/gateway.md


@dataclass(frozen=True, slots=True)
class Call:
    call_key: str
    session_id: str
    endpoint: str
    provider: str
    model: str
    stream: bool
    body_hash: str
    status: str  # inflight | done | failed | interrupted
    http_status: int | None
    content_type: str | None
    response: bytes | None
    usage: Usage | None
    upstream_request_id: str | None
    owner: str | None
    ok_entry_id: int | None


@dataclass(frozen=True, slots=True)
class Attempt:
    """What the ledger needs to know about the caller of one upstream request."""

    call_key: str
    run: Run
    provider: str
    model: str
    endpoint: str
    started_at: float


def process_owner() -> str:
    return f"{os.getpid()}:{os.urandom(6).hex()}"


def owner_alive(owner: str, me: str) -> bool:
    if owner == me:
        return True
    pid = int(owner.split(":", 1)[0])
    if pid == os.getpid():  # same pid, other nonce: an earlier process that had our pid (e.g. pid 1 in a container)
        return False
    return pids.alive(pid)


class Store:
    def __init__(self, path: Path, owner: str | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.owner = owner or process_owner()
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA busy_timeout=10000")
        with self.tx():
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    self.db.execute(stmt)
            row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                self.db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) == 1:
                for stmt in _MIGRATE_1_TO_2:
                    self.db.execute(stmt)
                self.db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
            elif int(row[0]) != SCHEMA_VERSION:
                raise StoreError(f"{path}: schema version {row[0]}, this gateway reads {SCHEMA_VERSION}")

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # --- runs and checkpoint marks -------------------------------------------------------------------------------

    def create_run(self, run: Run, token_hash: str, source_ip: str | None = None) -> None:
        """Record a run and, with `source_ip`, bind that address to it (replacing any earlier binding)."""
        with self.tx() as db:
            now = time.time()
            db.execute(
                "INSERT INTO runs (run_id, token_hash, session_id, sandbox_id, api_key_id, checkpoint_id, mode,"
                " parent_session_id, created_at, source_ip) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (run.run_id, token_hash, run.session_id, run.sandbox_id, run.api_key_id, run.checkpoint_id,
                 run.mode, run.parent_session_id, now, source_ip),
            )
            if source_ip is not None:
                db.execute("INSERT OR REPLACE INTO bindings VALUES (?,?,?)", (source_ip, run.run_id, now))

    def bound_run(self, source_ip: str) -> Run | None:
        """The run whose sandbox instance has this address now, if it is bound and not ended."""
        row = self.db.execute(
            "SELECT runs.* FROM bindings JOIN runs USING (run_id) WHERE bindings.source_ip=? AND ended_at IS NULL",
            (source_ip,),
        ).fetchone()
        return _run(row) if row else None

    def bindings(self) -> dict[str, str]:
        return {r[0]: r[1] for r in self.db.execute("SELECT source_ip, run_id FROM bindings")}

    def parent_session(self, session_id: str) -> str | None:
        """The session this one was forked from (recorded by its fork run; later runs of it need not repeat it)."""
        row = self.db.execute(
            "SELECT parent_session_id FROM runs WHERE session_id=? AND parent_session_id IS NOT NULL"
            " ORDER BY created_at LIMIT 1", (session_id,),
        ).fetchone()
        return row[0] if row else None

    def set_aligned(self, run_id: str, position: int) -> None:
        self.db.execute("UPDATE runs SET aligned_at=? WHERE run_id=? AND aligned_at IS NULL", (position, run_id))

    def run_by_token_hash(self, token_hash: str) -> Run | None:
        row = self.db.execute("SELECT * FROM runs WHERE token_hash=?", (token_hash,)).fetchone()
        return _run(row) if row else None

    def run(self, run_id: str) -> Run | None:
        row = self.db.execute("SELECT * FROM runs WHERE run_id=?", (run_id,)).fetchone()
        return _run(row) if row else None

    def active_run(self, session_id: str) -> Run | None:
        row = self.db.execute(
            "SELECT * FROM runs WHERE session_id=? AND ended_at IS NULL ORDER BY created_at DESC LIMIT 1",
            (session_id,),
        ).fetchone()
        return _run(row) if row else None

    def run_ended(self, run_id: str) -> bool:
        row = self.db.execute("SELECT ended_at FROM runs WHERE run_id=?", (run_id,)).fetchone()
        return row is None or row[0] is not None

    def end_run(self, run_id: str) -> None:
        with self.tx() as db:
            db.execute("UPDATE runs SET ended_at=? WHERE run_id=? AND ended_at IS NULL", (time.time(), run_id))
            db.execute("DELETE FROM bindings WHERE run_id=?", (run_id,))

    def next_ordinal(self, run_id: str) -> int:
        row = self.db.execute("SELECT MAX(ordinal) FROM positions WHERE run_id=?", (run_id,)).fetchone()
        return 0 if row[0] is None else row[0] + 1

    def positions(self, run_id: str) -> list[Position]:
        return [_position(r) for r in self.db.execute("SELECT * FROM positions WHERE run_id=? ORDER BY ordinal",
                                                      (run_id,))]

    def put_mark(self, mark: Mark) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO marks (checkpoint_id, session_id, run_id, position, created_at, last_position)"
            " VALUES (?,?,?,?,?,?)",
            (mark.checkpoint_id, mark.session_id, mark.run_id, mark.position, time.time(), mark.last_position),
        )

    def mark(self, checkpoint_id: str) -> Mark | None:
        row = self.db.execute("SELECT * FROM marks WHERE checkpoint_id=?", (checkpoint_id,)).fetchone()
        return _mark(row) if row else None

    def marks_of_run(self, run_id: str) -> list[Mark]:
        return [_mark(r) for r in self.db.execute("SELECT * FROM marks WHERE run_id=? ORDER BY created_at",
                                                  (run_id,))]

    # --- positions, calls, divergences ---------------------------------------------------------------------------

    def position(self, run_id: str, ordinal: int) -> Position | None:
        row = self.db.execute("SELECT * FROM positions WHERE run_id=? AND ordinal=?", (run_id, ordinal)).fetchone()
        return _position(row) if row else None

    def latest_position_with_hash(self, run_id: str, body_hash: str) -> Position | None:
        row = self.db.execute(
            "SELECT * FROM positions WHERE run_id=? AND body_hash=? ORDER BY ordinal DESC LIMIT 1", (run_id, body_hash)
        ).fetchone()
        return _position(row) if row else None

    def add_position(self, p: Position) -> None:
        arrived = time.time() if p.arrived_at is None else p.arrived_at
        delivered_at = (arrived if p.delivered_at is None else p.delivered_at) if p.delivered else None
        self.db.execute(
            "INSERT INTO positions (run_id, ordinal, call_key, body_hash, source, delivered, arrived_at, delivered_at)"
            " VALUES (?,?,?,?,?,?,?,?)",
            (p.run_id, p.ordinal, p.call_key, p.body_hash, p.source, int(p.delivered), arrived, delivered_at),
        )

    def set_delivered(self, run_id: str, ordinal: int) -> None:
        self.db.execute(
            "UPDATE positions SET delivered=1, delivered_at=COALESCE(delivered_at, ?) WHERE run_id=? AND ordinal=?",
            (time.time(), run_id, ordinal),
        )

    def record_divergence(self, run_id: str, ordinal: int, expected: Position, got_hash: str) -> None:
        self.db.execute(
            "INSERT INTO divergences (run_id, ordinal, expected_call_key, expected_hash, got_hash, created_at)"
            " VALUES (?,?,?,?,?,?)",
            (run_id, ordinal, expected.call_key, expected.body_hash, got_hash, time.time()),
        )

    def divergences(self, run_id: str | None = None) -> list[dict[str, Any]]:
        q = "SELECT * FROM divergences"
        args: tuple[str, ...] = ()
        if run_id is not None:
            q, args = q + " WHERE run_id=?", (run_id,)
        return [dict(r) for r in self.db.execute(q + " ORDER BY id", args)]

    def call(self, call_key: str) -> Call | None:
        row = self.db.execute("SELECT * FROM calls WHERE call_key=?", (call_key,)).fetchone()
        return _call(row) if row else None

    def calls(self) -> list[Call]:
        return [_call(r) for r in self.db.execute("SELECT * FROM calls ORDER BY created_at")]

    def begin_upstream(
        self, a: Attempt, stream: bool, body_hash: str, position: Position | None, budgets: list[tuple[str, str]],
        amount_nano: int,
    ) -> None:
        """Claim a call for one upstream request: position, call row `inflight`, budget reservations, atomically.

        Raises BudgetRefused (and writes nothing) if any budget in `budgets` that exists could be overrun."""
        with self.tx() as db:
            for scope, ident in budgets:
                row = db.execute(
                    "SELECT limit_nano, spent_nano, reserved_nano FROM budgets WHERE scope=? AND ident=?",
                    (scope, ident),
                ).fetchone()
                if row is None:
                    continue
                if row[1] + row[2] + amount_nano > row[0]:
                    raise BudgetRefused(scope, ident)
                db.execute(
                    "UPDATE budgets SET reserved_nano=reserved_nano+? WHERE scope=? AND ident=?",
                    (amount_nano, scope, ident),
                )
                db.execute(
                    "INSERT INTO reservations (call_key, owner, scope, ident, amount_nano) VALUES (?,?,?,?,?)",
                    (a.call_key, self.owner, scope, ident, amount_nano),
                )
            if position is not None:
                self.add_position(position)
            db.execute(
                "INSERT INTO calls (call_key, session_id, run_id, endpoint, provider, model, stream, body_hash, status,"
                " owner, attempts, created_at) VALUES (?,?,?,?,?,?,?,?,'inflight',?,1,?)"
                " ON CONFLICT(call_key) DO UPDATE SET status='inflight', owner=excluded.owner,"
                " attempts=attempts+1, http_status=NULL, response=NULL, usage=NULL",
                (a.call_key, a.run.session_id, a.run.run_id, a.endpoint, a.provider, a.model, int(stream), body_hash,
                 self.owner, a.started_at),
            )

    def finish_upstream(
        self, a: Attempt, *, ok: bool, outcome: str, http_status: int | None, content_type: str | None,
        response: bytes, usage: Usage | None, request_id: str | None, cost_nano: int, priced: bool,
        reserved: bool = True,
    ) -> int:
        """Store the response, write its ledger entry and turn the reservation into spending, atomically."""
        now = time.time()
        u = usage or Usage()
        with self.tx() as db:
            entry_id = self._insert_entry(db, "upstream", outcome, a, http_status, u, cost_nano, priced, request_id,
                                          None, now)
            db.execute(
                "UPDATE calls SET status=?, http_status=?, content_type=?, response=?, usage=?, upstream_request_id=?,"
                " ok_entry_id=CASE WHEN ? THEN ? ELSE ok_entry_id END, finished_at=?, owner=NULL WHERE call_key=?",
                ("done" if ok else "failed", http_status, content_type, response,
                 json.dumps(usage.to_dict()) if usage else None, request_id, ok, entry_id, now, a.call_key),
            )
            if reserved:
                self._settle(db, a.call_key, self.owner, cost_nano)
        return entry_id

    def record_served(self, kind: str, a: Attempt, original_entry_id: int | None, http_status: int | None) -> int:
        """A zero-cost ledger entry for an answer given without going upstream (`store` or `joined`)."""
        with self.tx() as db:
            return self._insert_entry(db, kind, "ok", a, http_status, Usage(), 0, True, None, original_entry_id,
                                      time.time())

    def _insert_entry(
        self, db: sqlite3.Connection, kind: str, outcome: str, a: Attempt, http_status: int | None, u: Usage,
        cost_nano: int, priced: bool, request_id: str | None, original: int | None, now: float,
    ) -> int:
        cur = db.execute(
            "INSERT INTO ledger (kind, outcome, call_key, session_id, sandbox_id, api_key_id, run_id, provider, model,"
            " endpoint, http_status, input_tokens, output_tokens, cached_tokens, cache_write_tokens, reasoning_tokens,"
            " cost_nano, priced, upstream_request_id, original_entry_id, started_at, finished_at)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (kind, outcome, a.call_key, a.run.session_id, a.run.sandbox_id, a.run.api_key_id, a.run.run_id,
             a.provider, a.model, a.endpoint, http_status, u.input_tokens, u.output_tokens, u.cached_tokens,
             u.cache_write_tokens, u.reasoning_tokens, cost_nano, int(priced), request_id, original, a.started_at,
             now),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    def _settle(self, db: sqlite3.Connection, call_key: str, owner: str, cost_nano: int | None) -> None:
        """Replace the call's reservations with its actual cost (None: charge the whole reservation)."""
        rows = db.execute(
            "SELECT id, scope, ident, amount_nano FROM reservations WHERE call_key=? AND owner=?", (call_key, owner)
        ).fetchall()
        for r in rows:
            spent = r["amount_nano"] if cost_nano is None else cost_nano
            db.execute(
                "UPDATE budgets SET reserved_nano=reserved_nano-?, spent_nano=spent_nano+? WHERE scope=? AND ident=?",
                (r["amount_nano"], spent, r["scope"], r["ident"]),
            )
            db.execute("DELETE FROM reservations WHERE id=?", (r["id"],))

    def recover(self) -> list[str]:
        """Mark calls whose owning process died `interrupted`, with a ledger entry each; charge their reservations.

        Returns their call keys."""
        found: list[str] = []
        with self.tx() as db:
            rows = db.execute("SELECT * FROM calls WHERE status='inflight'").fetchall()
            for row in rows:
                if row["owner"] is None or owner_alive(row["owner"], self.owner):
                    continue
                run = self.run(row["run_id"])
                assert run is not None
                a = Attempt(row["call_key"], run, row["provider"], row["model"], row["endpoint"], row["created_at"])
                self._insert_entry(db, "upstream", "interrupted", a, None, Usage(), 0, True, None, None, time.time())
                self._settle(db, row["call_key"], row["owner"], None)
                db.execute("UPDATE calls SET status='interrupted', owner=NULL WHERE call_key=?", (row["call_key"],))
                found.append(row["call_key"])
        return found

    # --- budgets and ledger --------------------------------------------------------------------------------------

    def set_budget(self, scope: str, ident: str, limit_nano: int) -> None:
        self.db.execute(
            "INSERT INTO budgets (scope, ident, limit_nano) VALUES (?,?,?)"
            " ON CONFLICT(scope, ident) DO UPDATE SET limit_nano=excluded.limit_nano",
            (scope, ident, limit_nano),
        )

    def budget(self, scope: str, ident: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM budgets WHERE scope=? AND ident=?", (scope, ident)).fetchone()
        return dict(row) if row else None

    def budgets(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.db.execute("SELECT * FROM budgets ORDER BY scope, ident")]

    def entries(self, session_id: str | None = None) -> list[dict[str, Any]]:
        q = "SELECT * FROM ledger"
        args: tuple[str, ...] = ()
        if session_id is not None:
            q, args = q + " WHERE session_id=?", (session_id,)
        return [dict(r) for r in self.db.execute(q + " ORDER BY entry_id", args)]


def _run(row: sqlite3.Row) -> Run:
    return Run(row["run_id"], row["session_id"], row["sandbox_id"], row["api_key_id"], row["checkpoint_id"],
               row["mode"], row["parent_session_id"], row["ended_at"] is not None, row["aligned_at"],
               row["source_ip"])


def _position(row: sqlite3.Row) -> Position:
    return Position(row["run_id"], row["ordinal"], row["call_key"], row["body_hash"], row["source"],
                    bool(row["delivered"]), row["arrived_at"], row["delivered_at"])


def _mark(row: sqlite3.Row) -> Mark:
    return Mark(row["checkpoint_id"], row["session_id"], row["run_id"], row["position"], row["last_position"])


def _call(row: sqlite3.Row) -> Call:
    return Call(
        row["call_key"], row["session_id"], row["endpoint"], row["provider"], row["model"], bool(row["stream"]),
        row["body_hash"], row["status"], row["http_status"], row["content_type"], row["response"],
        Usage.from_dict(json.loads(row["usage"])) if row["usage"] else None, row["upstream_request_id"],
        row["owner"], row["ok_entry_id"],
    )
