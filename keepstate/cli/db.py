"""`keepstate db`: the database's revision, its upgrade, and the import of an older release's files into it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from keepstate.config import home
from keepstate.db import legacy, migrate
from keepstate.db.engine import Database
from keepstate.db.setup import db_url
from keepstate.errors import NotFound

from .common import Group, emit_json, home_option, json_option
from .database import db_option


@click.group(cls=Group)
def db() -> None:
    """The database (--db, $KEEPSTATE_DB, default <home>/keepstate.sqlite): docs/design/database.md.

    \b
    Examples:
      keepstate db status
      keepstate db upgrade --db postgresql://keepstate@/keepstate?host=/run/postgresql
      keepstate db import --from /var/lib/keepstate --db postgresql://keepstate@db.internal/keepstate
    """


@db.command("status")
@json_option()
@home_option
@db_option
def status(as_json: bool) -> None:
    """The database's revision and this release's."""

    async def read() -> tuple[str, tuple[str, ...]]:
        opened = await Database.open(db_url(home()))
        try:
            return opened.url.shown, await migrate.current(opened)
        finally:
            await opened.close()

    shown, at = asyncio.run(read())
    out = {"database": shown, "revision": list(at), "release": migrate.head(), "files": [
        str(p) for p in legacy.legacy_files(home())]}
    if as_json:
        emit_json(out)
        return
    click.echo(f"{shown}: revision {', '.join(at) or '(none: never upgraded)'}; this release: {out['release']}")
    for path in out["files"]:
        click.echo(f"not imported yet: {path} (`keepstate db import --from {Path(path).parent}`)")


@db.command("upgrade")
@home_option
@db_option
def upgrade() -> None:
    """Bring the database to this release's schema (`keepstate serve` does it at start too)."""

    async def run() -> str:
        opened = await Database.open(db_url(home()))
        try:
            return await migrate.upgrade(opened)
        finally:
            await opened.close()

    click.echo(f"at revision {asyncio.run(run())}", err=True)


@db.command("import")
@click.option("--from", "source", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The data directory holding an older release's catalog.sqlite, sessions.sqlite and "
                   "gateway.sqlite (default: --home).")
@click.option("--node", default="local", show_default=True, help="The node the imported sandboxes belong to.")
@home_option
@db_option
def import_(source: Path | None, node: str) -> None:
    """Copy an older release's files into the database, in one transaction, then rename them *.imported (a server
    on SQLite does this itself at its first start; on PostgreSQL it is this command)."""
    source = source or home()
    if not legacy.legacy_files(source):
        raise NotFound(f"{source} holds no catalog.sqlite, sessions.sqlite or gateway.sqlite to import")

    async def run() -> dict[str, int] | None:
        opened = await Database.open(db_url(home()))
        try:
            await migrate.upgrade(opened)
            return await legacy.import_home(opened, source, node)
        finally:
            await opened.close()

    counts = asyncio.run(run())
    if counts is None:
        click.echo("already imported: the files were renamed *.imported", err=True)
        return
    click.echo("imported " + ", ".join(f"{n} {table}" for table, n in counts.items() if n), err=True)
