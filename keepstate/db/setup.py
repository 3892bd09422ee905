"""What a server or a command does before it uses the database: open it, upgrade its schema, and import the files
of an older release from the data directory (legacy.py).

    db = await prepare(url, home)     # BadDatabaseURL, DatabaseUnavailable, SchemaTooNew, LegacyImportRefused
"""

from __future__ import annotations

import os
from pathlib import Path

from keepstate.db import legacy, migrate
from keepstate.db.engine import Database
from keepstate.db.url import default_url

LOCAL_NODE = "local"  # the node of a server that is not part of a cluster


def db_url(home: Path) -> str:
    """The database to use: $KEEPSTATE_DB, else the embedded default in the data directory."""
    return os.environ.get("KEEPSTATE_DB") or default_url(home)


async def prepare(url: str, home: Path, node_id: str = LOCAL_NODE) -> Database:
    """The database at `url`, open, at this release's schema, with `home`'s older files imported into it (on SQLite;
    on PostgreSQL only by `keepstate db import`, explicitly)."""
    db = await Database.open(url)
    try:
        await upgrade(db, home, node_id)
    except BaseException:
        await db.close()
        raise
    return db


async def upgrade(db: Database, home: Path, node_id: str = LOCAL_NODE) -> None:
    """Bring an open database to this release's schema and import `home`'s older files (as `prepare`)."""
    await migrate.upgrade(db)
    if db.kind == "sqlite":
        await legacy.import_home(db, home, node_id)
