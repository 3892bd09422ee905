"""`upgrade head` at start, run in code (no alembic.ini), once however many servers start at once.

The whole upgrade is one transaction that first takes a lock: on SQLite the write lock, which the write transaction's
BEGIN IMMEDIATE holds from its first statement; on PostgreSQL `pg_advisory_xact_lock` on a fixed key. A second
server starting at the same time waits, then finds the database at head and does nothing. A database at a revision
this release does not know (written by a newer one) is refused with SchemaTooNew before anything changes.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import text
from sqlalchemy.engine import Connection

from keepstate.db.engine import Database
from keepstate.db.errors import SchemaTooNew

MIGRATIONS = Path(__file__).parent / "migrations"
# pg_advisory_xact_lock's key: any fixed 64-bit number names "the upgrade of this database"; b"keepstat" as an int.
UPGRADE_LOCK_KEY = int.from_bytes(b"keepstat", "big")


def alembic_config(connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head() -> str:
    """The newest revision this release knows."""
    found = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert found is not None
    return found


async def current(db: Database) -> tuple[str, ...]:
    """The revisions the database is at (empty: never upgraded)."""
    async with db.read() as conn:
        return await conn.run_sync(lambda c: tuple(MigrationContext.configure(c).get_current_heads()))


async def upgrade(db: Database) -> str:
    """Bring the database to this release's head revision; the revision it is at afterwards."""
    async with db.transaction() as conn:
        if db.kind == "postgresql":
            await conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": UPGRADE_LOCK_KEY})
        return await conn.run_sync(_upgrade)


def _upgrade(conn: Connection) -> str:
    cfg = alembic_config(conn)
    script = ScriptDirectory.from_config(cfg)
    newest = script.get_current_head()
    assert newest is not None
    for at in MigrationContext.configure(conn).get_current_heads():
        try:
            script.get_revision(at)
        except CommandError:
            raise SchemaTooNew(at, newest) from None
    command.upgrade(cfg, "head")
    return newest
