"""Fixtures for the database layer's tests: every test that takes `database` (or `db_url`) runs on SQLite and on a
real PostgreSQL 15, started once for the session on a Unix socket (keepstate.testing.postgres)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from keepstate.db import migrate
from keepstate.db.engine import Database
from keepstate.db.url import default_url
from keepstate.testing.postgres import PostgresServer, installed

from .race import HeldCommit

KINDS = ["sqlite", "postgresql"]


def require_postgres() -> None:
    if not installed():
        pytest.skip("PostgreSQL 15 is not installed (Debian's `postgresql`; scripts/setup-host.sh installs it)")


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    require_postgres()
    with PostgresServer() as pg:
        yield pg


@pytest.fixture(params=KINDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of a new, empty database: a new SQLite file, or a new database (createdb) on the session's server."""
    if request.param == "sqlite":
        return default_url(tmp_path / "home")
    pg: PostgresServer = request.getfixturevalue("postgres")
    return pg.createdb(f"t_{secrets.token_hex(6)}")


@pytest.fixture
async def database(db_url: str) -> AsyncIterator[Database]:
    """An open Database on a new database, upgraded to head."""
    db = await Database.open(db_url)
    try:
        await migrate.upgrade(db)
        yield db
    finally:
        await db.close()


@pytest.fixture
async def other_database(database: Database) -> AsyncIterator[Database]:
    """A second Database on the same database: another server's view of it."""
    db = await Database.open(database.url)
    try:
        yield db
    finally:
        await db.close()


@pytest.fixture
async def held_database(database: Database) -> AsyncIterator[HeldCommit]:
    """A Database on the same database whose write transactions commit only when the test says (race.py)."""
    db = await HeldCommit.open(database.url)
    assert isinstance(db, HeldCommit)
    try:
        yield db
    finally:
        db.release.set()
        await db.close()
