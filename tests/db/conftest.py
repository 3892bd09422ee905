"""Fixtures for the database layer's tests: every test that takes `database` (or `db_url`) runs on SQLite and on a
real PostgreSQL 15, started once for the session on a Unix socket (keepstate.testing.postgres)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from keepstate.db.engine import Database
from keepstate.testing.databases import database, db_url, postgres, require_postgres  # noqa: F401

from .race import HeldCommit


@pytest.fixture
async def other_database(database: Database) -> AsyncIterator[Database]:  # noqa: F811
    """A second Database on the same database: another server's view of it."""
    db = await Database.open(database.url)
    try:
        yield db
    finally:
        await db.close()


@pytest.fixture
async def held_database(database: Database) -> AsyncIterator[HeldCommit]:  # noqa: F811
    """A Database on the same database whose write transactions commit only when the test says (race.py)."""
    db = await HeldCommit.open(database.url)
    assert isinstance(db, HeldCommit)
    try:
        yield db
    finally:
        db.release.set()
        await db.close()
