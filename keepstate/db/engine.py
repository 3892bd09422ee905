"""The one way into the database: an engine per database kind, transactions, and the errors that mean "down".

    db = await Database.open("sqlite:///home/keepstate.sqlite")   # or postgresql://...; fails fast if unreachable
    async with db.transaction() as conn: ...   # a write transaction, committed at the end of the block
    async with db.read() as conn: ...          # a read-only one: a consistent snapshot for its statements
    await db.close()

SQLite (docs/design/database.md, "Concurrency rules"): WAL, synchronous=NORMAL, busy_timeout 5 s; one writer
connection whose transactions begin IMMEDIATE (the write lock is taken at BEGIN, so a transaction never upgrades a
read lock to a write lock, which deadlocks), readers pooled with plain (deferred) BEGIN. The sqlite3 driver's own
BEGIN handling is turned off and we emit ours (SQLAlchemy's SQLite dialect documentation, "Enabling Non-Legacy
SQLite Transactional Modes": Python 3.11 lacks `autocommit=False`). Statements run on the loop's thread through
SQLAlchemy's synchronous engine (inline_sqlite.py says why that never waits there, and why it is not asyncio's).

PostgreSQL: psycopg 3 (libpq), READ COMMITTED, `statement_timeout` 10 s, `connect_timeout` 5 s unless the URL sets
one, and pre-ping on checkout, so a server that restarted costs no failed call once it is back.

A driver error that means the database cannot be reached or answer now (a lost connection, a refused connect, a
timeout, SQLite busy past its timeout, an I/O error) is raised as DatabaseUnavailable (503, Retry-After); any other
error (a constraint, a bug in a statement) passes through as SQLAlchemy's.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

import psycopg
from sqlalchemy import event, exc, text
from sqlalchemy.engine import Connection, CursorResult, Engine, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from keepstate.db import inline_sqlite
from keepstate.db.errors import DatabaseUnavailable
from keepstate.db.url import DatabaseURL, Kind, parse
from keepstate.errors import BadRequest

SQLITE_BUSY_TIMEOUT_MS = 5000
PG_STATEMENT_TIMEOUT = "10s"
PG_CONNECT_TIMEOUT_S = 5
POOL_TIMEOUT_S = 10.0  # waiting for a free connection of the pool: bounded like a statement

# SQLite result codes (by name prefix: extended codes such as SQLITE_BUSY_SNAPSHOT or SQLITE_IOERR_WRITE included)
# that say the database cannot be used right now, as opposed to a statement that is wrong.
_SQLITE_UNAVAILABLE = ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_CANTOPEN", "SQLITE_IOERR", "SQLITE_FULL",
                       "SQLITE_PROTOCOL")


T = TypeVar("T")


class Conn(Protocol):
    """A transaction's connection, on either kind: SQLAlchemy's AsyncConnection (PostgreSQL) or inline_sqlite's."""

    async def execute(self, statement: Any, parameters: Any = None) -> CursorResult[Any]: ...

    async def scalar(self, statement: Any, parameters: Any = None) -> Any: ...

    async def run_sync(self, fn: Callable[[Connection], T]) -> T: ...


class Database:
    """An open database: one for the whole process, shared by every repository."""

    def __init__(self, url: DatabaseURL, engine: AsyncEngine | inline_sqlite.InlineSQLite) -> None:
        self.url = url
        self._engine = engine
        if isinstance(engine, AsyncEngine):
            event.listen(engine.sync_engine, "before_cursor_execute", _refuse_nul)

    @property
    def kind(self) -> Kind:
        return self.url.kind

    @classmethod
    def connect(cls, url: str | DatabaseURL) -> Database:
        """The Database of `url` (see keepstate.db.url), connecting to nothing yet: its first statement connects. For
        code that must be built before the event loop runs (the server's application); `open` when it runs."""
        parsed = parse(url) if isinstance(url, str) else url
        if parsed.kind == "sqlite":
            assert parsed.path is not None
            try:
                parsed.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise DatabaseUnavailable(f"{parsed.shown}: cannot make {parsed.path.parent}: {e.strerror}") from e
            return cls(parsed, inline_sqlite.InlineSQLite(str(parsed.path), SQLITE_BUSY_TIMEOUT_MS / 1000, _prepare))
        return cls(parsed, _postgres_engine(parsed))

    @classmethod
    async def open(cls, url: str | DatabaseURL) -> Database:
        """Open `url` and check it answers: BadDatabaseURL or DatabaseUnavailable if not."""
        db = cls.connect(url)
        try:
            await db.ping()
        except BaseException:
            await db.close()
            raise
        return db

    async def ping(self) -> None:
        """One round trip: DatabaseUnavailable if the database does not answer."""
        async with self.read() as conn:
            await conn.execute(text("SELECT 1"))

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Conn]:
        """A write transaction: committed when the block ends, rolled back if it raises."""
        if isinstance(self._engine, AsyncEngine):
            async with self._translated(), self._engine.begin() as conn:
                yield conn
        else:
            async with self._translated(), self._engine.transaction(POOL_TIMEOUT_S) as inline:
                yield inline

    @asynccontextmanager
    async def read(self) -> AsyncIterator[Conn]:
        """A transaction for reads only (on SQLite it takes no write lock, and must not write)."""
        if isinstance(self._engine, AsyncEngine):
            async with self._translated(), self._engine.begin() as conn:
                yield conn
        else:
            async with self._translated(), self._engine.read() as inline:
                yield inline

    async def close(self) -> None:
        if isinstance(self._engine, AsyncEngine):
            await self._engine.dispose()
        else:
            self._engine.close()

    @asynccontextmanager
    async def _translated(self) -> AsyncIterator[None]:
        try:
            yield
        except Exception as e:
            why = unavailable_reason(e)
            if why is None:
                raise
            raise DatabaseUnavailable(f"{self.url.shown}: {why}") from e


def _refuse_nul(conn: Connection, cursor: Any, statement: str, parameters: Any, context: Any,
                executemany: bool) -> None:
    """A text value with a NUL character is refused before it reaches either database: PostgreSQL's text cannot hold
    one (a DataError, which would be a 500), SQLite's can; refusing it on both keeps them alike. Bytes pass."""
    rows = parameters if executemany else [parameters]
    for row in rows or ():
        values = row.values() if isinstance(row, dict) else row
        for value in values or ():
            if isinstance(value, str) and "\x00" in value:
                raise BadRequest("a text value cannot contain the NUL character (U+0000)")


def unavailable_reason(e: BaseException) -> str | None:
    """Why `e` means the database cannot be reached or cannot answer now; None for any other error."""
    if isinstance(e, exc.TimeoutError):  # the pool had no connection to give in time
        return str(e).splitlines()[0]
    if isinstance(e, sqlite3.Error):  # raised by inline_sqlite itself (its BEGIN, its writers' queue): not wrapped
        orig: BaseException = e
    elif isinstance(e, exc.DBAPIError) and e.orig is not None:
        orig = e.orig
    else:
        return None
    reason = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
    if isinstance(e, exc.DBAPIError) and e.connection_invalidated or isinstance(orig, psycopg.OperationalError):
        return reason
    if isinstance(orig, sqlite3.Error) and (str(getattr(orig, "sqlite_errorname", "")).startswith(_SQLITE_UNAVAILABLE)
                                            or reason.endswith("database is locked")):
        return reason
    return None


def _prepare(engine: Engine) -> None:
    event.listen(engine, "before_cursor_execute", _refuse_nul)


def _postgres_engine(url: DatabaseURL) -> AsyncEngine:
    query = make_url(url.sqlalchemy_url).query
    theirs = query.get("options")
    # Ours first, so an operator's own `-c statement_timeout=` in the URL's options wins.
    options = f"-c statement_timeout={PG_STATEMENT_TIMEOUT}"
    if isinstance(theirs, str) and theirs:
        options += " " + theirs
    connect_args: dict[str, Any] = {"options": options}
    if "connect_timeout" not in query:
        connect_args["connect_timeout"] = PG_CONNECT_TIMEOUT_S
    return create_async_engine(url.sqlalchemy_url, connect_args=connect_args, pool_pre_ping=True,
                               pool_timeout=POOL_TIMEOUT_S)
