"""An aiosqlite-shaped connection that runs SQLite statements on the calling thread, for SQLAlchemy's
`sqlite+aiosqlite` dialect (`create_async_engine(..., async_creator=connect)`).

Why: aiosqlite hands every DBAPI call (cursor, execute, fetch, close, BEGIN, COMMIT) to a thread of its own and
back; measured here, about 8 such hops and 1 ms per transaction, 150 times a plain sqlite3 statement (7 us). The
gateway makes about seven transactions per model call: 13 ms added where the goal is under 1 ms
(benchmarks/db.py, 2026-12-05).

Why it does not block the event loop: in WAL mode a reader never waits for a lock, and a writer waits only to take
the write lock, which our write transactions take at their first statement (`BEGIN IMMEDIATE`, engine.py). So the
connection runs with `busy_timeout` 0, and a `BEGIN IMMEDIATE` that finds the lock held (another process writing:
a CLI command, a standalone gateway) is retried after an `await asyncio.sleep`, until the engine's busy timeout
passes, then raised as SQLite's own "database is locked" (DatabaseUnavailable, 503). Every other statement runs
at once: microseconds, with `synchronous=NORMAL` (no fsync at commit). What can still take longer on the loop is a
WAL checkpoint (every 1000 pages written), which fsyncs: milliseconds.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

BEGIN_RETRY_S = 0.002  # the first wait for another process's write lock; doubled up to BEGIN_RETRY_MAX_S
BEGIN_RETRY_MAX_S = 0.05


class _Now:
    """aiosqlite's queue of calls for its thread (the dialect puts the isolation-level setter on it): run now."""

    def put_nowait(self, item: tuple[asyncio.Future[Any], Callable[[], Any]]) -> None:
        future, function = item
        try:
            future.set_result(function())
        except Exception as e:  # noqa: BLE001 - handed to the awaiting caller, as aiosqlite does
            future.set_exception(e)


class Cursor:
    def __init__(self, cursor: sqlite3.Cursor, busy_timeout_s: float) -> None:
        self._cursor = cursor
        self._busy_timeout_s = busy_timeout_s

    async def __aenter__(self) -> Cursor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._cursor.close()

    @property
    def description(self) -> Any:
        return self._cursor.description

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount

    @property
    def lastrowid(self) -> int | None:
        return self._cursor.lastrowid

    @property
    def arraysize(self) -> int:
        return self._cursor.arraysize

    @arraysize.setter
    def arraysize(self, value: int) -> None:
        self._cursor.arraysize = value

    async def execute(self, sql: str, parameters: Sequence[Any] | dict[str, Any] = ()) -> Cursor:
        if sql.lstrip().upper().startswith("BEGIN IMMEDIATE"):
            await self._begin_immediate(sql)
        else:
            self._cursor.execute(sql, parameters)
        return self

    async def _begin_immediate(self, sql: str) -> None:
        deadline = time.monotonic() + self._busy_timeout_s
        wait = BEGIN_RETRY_S
        while True:
            try:
                self._cursor.execute(sql)
                return
            except sqlite3.OperationalError as e:
                if getattr(e, "sqlite_errorname", "") != "SQLITE_BUSY" or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(wait)
            wait = min(wait * 2, BEGIN_RETRY_MAX_S)

    async def executemany(self, sql: str, seq_of_parameters: Iterable[Any]) -> Cursor:
        self._cursor.executemany(sql, seq_of_parameters)
        return self

    async def fetchall(self) -> list[Any]:
        return self._cursor.fetchall()

    async def fetchone(self) -> Any:
        return self._cursor.fetchone()

    async def fetchmany(self, size: int | None = None) -> list[Any]:
        return self._cursor.fetchmany(size if size is not None else self._cursor.arraysize)

    async def close(self) -> None:
        self._cursor.close()


class Connection:
    def __init__(self, conn: sqlite3.Connection, busy_timeout_s: float) -> None:
        self._conn = conn
        self._connection = conn  # what the dialect checks before a commit or rollback
        self._tx = _Now()
        self._busy_timeout_s = busy_timeout_s

    @property
    def isolation_level(self) -> str | None:
        return self._conn.isolation_level

    def cursor(self) -> Cursor:
        return Cursor(self._conn.cursor(), self._busy_timeout_s)

    async def execute(self, sql: str, parameters: Sequence[Any] | dict[str, Any] = ()) -> Cursor:
        return await self.cursor().execute(sql, parameters)

    async def create_function(self, *args: Any, **kw: Any) -> None:
        self._conn.create_function(*args, **kw)

    async def commit(self) -> None:
        self._conn.commit()

    async def rollback(self) -> None:
        self._conn.rollback()

    async def close(self) -> None:
        self._conn.close()

    def stop(self) -> None:
        self._conn.close()


def creator(path: str, busy_timeout_s: float) -> Callable[[], Any]:
    """The `async_creator` of an engine on the SQLite file `path`."""

    async def connect() -> Connection:
        conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            # Once per connection (a pool keeps them): turning a new file to WAL may wait for a lock, here only.
            conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=0")  # from now on never wait on the loop: BEGIN IMMEDIATE retries
        except BaseException:
            conn.close()
            raise
        return Connection(conn, busy_timeout_s)

    return connect
