"""SQLite on the event loop's own thread: SQLAlchemy's synchronous engine (the stdlib `sqlite3` driver) behind the
same awaitable connection the PostgreSQL engine gives, so repositories are written once.

Why not an async driver: aiosqlite hands every DBAPI call to a thread of its own and back (about 8 hops and 1 ms
per transaction here, 150 times a plain statement), and even with the calls made in place, SQLAlchemy's asyncio
layer (a greenlet per call, an awaited pool checkout) cost 0.17 ms of a 0.2 ms one-statement transaction. The
synchronous engine runs the same transaction in 0.03 ms (benchmarks/db.py). The metering gateway makes about seven
transactions per model call, and its goal is under 1 ms added.

Why it does not block the event loop: in WAL mode a reader never waits for a lock, and a writer waits only to take
the write lock, which our write transactions take at their first statement (`BEGIN IMMEDIATE`). So connections run
with `busy_timeout` 0, and a `BEGIN IMMEDIATE` that finds the lock held (another process writing: a CLI command, a
standalone gateway) is retried after an `await asyncio.sleep`, until the busy timeout passes, then raised as
SQLite's own "database is locked" (DatabaseUnavailable, 503). Writers of this process queue on an asyncio lock,
never on SQLite. Every other statement runs at once: microseconds, with `synchronous=NORMAL` (no fsync at commit).
What can still take longer on the loop is a WAL checkpoint (every 1000 pages written), which fsyncs: milliseconds.

Rows are fetched when a statement runs (as the asyncio engine's drivers do), so a result read after its transaction
ended is still whole.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from sqlalchemy import create_engine, pool
from sqlalchemy.engine import Connection, CursorResult, Engine

BEGIN_RETRY_S = 0.002  # the first wait for another process's write lock; doubled up to BEGIN_RETRY_MAX_S
BEGIN_RETRY_MAX_S = 0.05
READERS = 8  # idle reader connections kept; more are opened (never waited for) when more read at once

T = TypeVar("T")


class _Cursor(sqlite3.Cursor):
    """A cursor that fetches a statement's rows as it runs it."""

    _rows: list[Any]
    _at: int

    def execute(self, sql: str, parameters: Any = (), /) -> _Cursor:
        super().execute(sql, parameters)
        self._rows, self._at = (super().fetchall() if self.description is not None else []), 0
        return self

    def executemany(self, sql: str, seq_of_parameters: Iterable[Any], /) -> _Cursor:
        super().executemany(sql, seq_of_parameters)
        self._rows, self._at = [], 0
        return self

    def fetchone(self) -> Any:
        if self._at >= len(self._rows):
            return None
        self._at += 1
        return self._rows[self._at - 1]

    def fetchmany(self, size: int | None = None) -> list[Any]:
        n = self.arraysize if size is None else size
        out = self._rows[self._at:self._at + n]
        self._at += len(out)
        return out

    def fetchall(self) -> list[Any]:
        out = self._rows[self._at:]
        self._at = len(self._rows)
        return out


class _Connection(sqlite3.Connection):
    def cursor(self, factory: Any = _Cursor) -> Any:
        return super().cursor(factory)


class InlineConnection:
    """What a transaction's block gets: the asyncio engine's `execute` and `run_sync`, run in place."""

    def __init__(self, conn: Connection) -> None:
        self.sync_connection = conn

    async def execute(self, statement: Any, parameters: Any = None) -> CursorResult[Any]:
        return self.sync_connection.execute(statement, parameters)

    async def scalar(self, statement: Any, parameters: Any = None) -> Any:
        return self.sync_connection.scalar(statement, parameters)

    async def run_sync(self, fn: Callable[[Connection], T]) -> T:
        return fn(self.sync_connection)


class InlineSQLite:
    """The SQLite file `path`: one writer connection, pooled readers, all used on the loop's thread."""

    def __init__(self, path: str, busy_timeout_s: float, prepare: Callable[[Engine], None]) -> None:
        self.busy_timeout_s = busy_timeout_s

        def connect() -> sqlite3.Connection:
            conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, factory=_Connection)
            try:
                # Once per connection: turning a new file to WAL may wait for a lock, here only.
                conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.execute("PRAGMA busy_timeout=0")  # from now on never wait on the loop: BEGIN IMMEDIATE retries
            except BaseException:
                conn.close()
                raise
            return conn

        # The driver's own BEGIN handling is off (isolation_level=None): SQLAlchemy's begin is bookkeeping only,
        # and transactions begin with the statement written out below. No pool of SQLAlchemy's: the connections
        # kept between transactions (making one costs more than a short transaction) are kept below, whole.
        self.engine = create_engine("sqlite://", creator=connect, poolclass=pool.NullPool)
        prepare(self.engine)
        self._write = asyncio.Lock()  # writers of this process queue here, never on SQLite's lock
        # The writer's connection and idle readers'; all on the loop's thread, so a list is enough.
        self._writer_conn: Connection | None = None
        self._idle_readers: list[Connection] = []

    @asynccontextmanager
    async def transaction(self, wait_s: float) -> AsyncIterator[InlineConnection]:
        if self._write.locked():
            try:
                async with asyncio.timeout(wait_s):  # not wait_for: 3.11's can lose a cancellation (gh-86296)
                    await self._write.acquire()
            except TimeoutError:
                raise sqlite3.OperationalError(f"no write transaction could start within {wait_s:.0f} s: "
                                               "database is locked") from None
        else:
            await self._write.acquire()  # free: taken without suspending
        try:
            conn, self._writer_conn = self._writer_conn or self.engine.connect(), None
            try:
                await self._begin_immediate(conn)
                with _ending(conn):
                    yield InlineConnection(conn)
            except BaseException:
                conn.close()  # after any error it is made anew
                raise
            self._writer_conn = conn
        finally:
            self._write.release()

    @asynccontextmanager
    async def read(self) -> AsyncIterator[InlineConnection]:
        conn = self._idle_readers.pop() if self._idle_readers else self.engine.connect()
        try:
            raw = conn.connection.dbapi_connection
            assert raw is not None
            conn.begin()
            raw.execute("BEGIN")
            with _ending(conn):
                yield InlineConnection(conn)
        except BaseException:
            conn.close()
            raise
        if len(self._idle_readers) < READERS:
            self._idle_readers.append(conn)
        else:
            conn.close()

    async def _begin_immediate(self, conn: Connection) -> None:
        raw = conn.connection.dbapi_connection
        assert raw is not None
        conn.begin()
        deadline = time.monotonic() + self.busy_timeout_s
        wait = BEGIN_RETRY_S
        while True:
            try:
                raw.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as e:
                if getattr(e, "sqlite_errorname", "") != "SQLITE_BUSY" or time.monotonic() >= deadline:
                    conn.rollback()
                    raise
            await asyncio.sleep(wait)
            wait = min(wait * 2, BEGIN_RETRY_MAX_S)

    def close(self) -> None:
        for conn in [*self._idle_readers, *([self._writer_conn] if self._writer_conn is not None else [])]:
            conn.close()
        self._idle_readers, self._writer_conn = [], None
        self.engine.dispose()


class _ending:
    """Commit when the block ends, roll back if it raises (a cancellation included): synchronous, so nothing can
    come between the block and its end."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self.conn.commit()
        else:
            self.conn.rollback()
