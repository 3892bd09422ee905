"""Pytest fixtures for tests that need a database: import them into a conftest.py.

    from keepstate.testing.databases import database, db_url, postgres  # noqa: F401

Every test that takes `database` (or `db_url`) runs twice: on a new SQLite file and on a new database of a real
PostgreSQL 15, started once per test session on a Unix socket (keepstate.testing.postgres) and stopped after it.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from keepstate.db import migrate
from keepstate.db.engine import Database
from keepstate.db.url import default_url
from keepstate.testing.postgres import PostgresServer, installed

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
