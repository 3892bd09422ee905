"""The one way into the database: an async engine per database kind, transactions, and the errors that mean "down".

    db = await Database.open("sqlite:///home/keepstate.sqlite")   # or postgresql://...; fails fast if unreachable
    async with db.transaction() as conn: ...   # a write transaction, committed at the end of the block
    async with db.read() as conn: ...          # a read-only one: a consistent snapshot for its statements
    await db.close()

SQLite (docs/design/database.md, "Concurrency rules"): WAL, synchronous=NORMAL, busy_timeout 5 s; one writer
connection whose transactions begin IMMEDIATE (the write lock is taken at BEGIN, so a transaction never upgrades a
read lock to a write lock, which deadlocks), readers pooled with plain (deferred) BEGIN. The sqlite3 driver's own
BEGIN handling is turned off and SQLAlchemy emits ours: the recipe of SQLAlchemy's SQLite dialect documentation
("Enabling Non-Legacy SQLite Transactional Modes"), needed on Python 3.11, which lacks `autocommit=False`.

PostgreSQL: psycopg 3 (libpq), READ COMMITTED, `statement_timeout` 10 s, `connect_timeout` 5 s unless the URL sets
one, and pre-ping on checkout, so a server that restarted costs no failed call once it is back.

A driver error that means the database cannot be reached or answer now (a lost connection, a refused connect, a
timeout, SQLite busy past its timeout, an I/O error) is raised as DatabaseUnavailable (503, Retry-After); any other
error (a constraint, a bug in a statement) passes through as SQLAlchemy's.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from sqlalchemy import event, exc, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

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


class Database:
    """An open database: one for the whole process, shared by every repository."""

    def __init__(self, url: DatabaseURL, writer: AsyncEngine, reader: AsyncEngine) -> None:
        self.url = url
        self._writer = writer
        self._reader = reader
        for engine in {id(writer): writer, id(reader): reader}.values():
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
            return cls(parsed, _sqlite_engine(parsed, write=True), _sqlite_engine(parsed, write=False))
        engine = _postgres_engine(parsed)
        return cls(parsed, engine, engine)

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
    async def transaction(self) -> AsyncIterator[AsyncConnection]:
        """A write transaction: committed when the block ends, rolled back if it raises."""
        async with self._translated(), self._writer.begin() as conn:
            yield conn

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """A transaction for reads only (on SQLite it takes no write lock, and must not write)."""
        async with self._translated(), self._reader.begin() as conn:
            yield conn

    async def close(self) -> None:
        await self._writer.dispose()
        if self._reader is not self._writer:
            await self._reader.dispose()

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
    if not isinstance(e, exc.DBAPIError):
        return None
    orig = e.orig
    reason = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
    if e.connection_invalidated or isinstance(orig, psycopg.OperationalError):
        return reason
    if isinstance(orig, sqlite3.Error) and str(getattr(orig, "sqlite_errorname", "")).startswith(_SQLITE_UNAVAILABLE):
        return reason
    return None


def _sqlite_engine(url: DatabaseURL, *, write: bool) -> AsyncEngine:
    # Statements run on the loop's thread (inline_sqlite.py: why, and why that never waits for a lock there); every
    # transaction ends in a COMMIT or ROLLBACK of its own, so a connection needs no reset when it goes back.
    assert url.path is not None
    options: dict[str, Any] = {"async_creator": inline_sqlite.creator(str(url.path), SQLITE_BUSY_TIMEOUT_MS / 1000),
                               "pool_timeout": POOL_TIMEOUT_S, "pool_reset_on_return": None}
    if write:  # one writer connection: writers of this process queue here, not on SQLite's busy loop
        options |= {"pool_size": 1, "max_overflow": 0}
    engine = create_async_engine(url.sqlalchemy_url, **options)
    begin = "BEGIN IMMEDIATE" if write else "BEGIN"

    @event.listens_for(engine.sync_engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # the driver emits no BEGIN of its own: _begin does

    @event.listens_for(engine.sync_engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql(begin)

    return engine


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
