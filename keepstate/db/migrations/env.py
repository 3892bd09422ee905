"""Alembic's environment for KeepState's one database (docs/design/database.md, "Migrations and the upgrade").

keepstate.db.migrate.upgrade runs it with a connection that is already inside the transaction holding the upgrade
lock (`config.attributes["connection"]`): the revisions run on that connection and the caller commits. Run by the
`alembic` command (a developer writing a revision, with `script_location` set to this folder), it opens the --db URL
in the config's `sqlalchemy.url` itself, on the async engine, and runs the revisions in one transaction.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from keepstate.db.schema import metadata


def run_migrations(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite's ALTER TABLE rebuilds the table
        transactional_ddl=True,  # SQLite's DDL is transactional too once the driver's BEGIN handling is off
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_from_url(url: str) -> None:
    from keepstate.db.engine import Database

    db = await Database.open(url)
    try:
        async with db.transaction() as conn:
            await conn.run_sync(run_migrations)
    finally:
        await db.close()


def _run_offline(url: str) -> None:
    from keepstate.db.url import parse

    parsed = parse(url)
    context.configure(url=parsed.sqlalchemy_url, target_metadata=metadata, literal_binds=True,
                      dialect_opts={"paramstyle": "named"}, render_as_batch=parsed.kind == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


def _main() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        run_migrations(connection)
        return
    url = context.config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("set sqlalchemy.url to a --db URL (sqlite:///PATH or postgresql://...)")
    if context.is_offline_mode():
        _run_offline(url)
    else:
        asyncio.run(_run_from_url(url))


_main()
