"""`--db URL` on every command that reads or writes state, and the one way such a command opens the database.

    @db_option
    def cmd() -> None:
        run(lambda db: Keys(db).list())
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click

from keepstate.config import home
from keepstate.db.engine import Database
from keepstate.db.setup import db_url, prepare

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

DB_HELP = ("The database: sqlite:///PATH (default: <home>/keepstate.sqlite) or postgresql://USER@HOST/NAME "
           "(libpq URLs, Unix sockets as ?host=/dir). docs/design/database.md")


def db_option(f: F) -> F:
    def set_db(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value:
            os.environ["KEEPSTATE_DB"] = value
        return value

    return click.option("--db", "db", envvar="KEEPSTATE_DB", callback=set_db, expose_value=False,
                        help=DB_HELP)(f)


def run(action: Callable[[Database], Awaitable[T]]) -> T:
    """Open the database (upgraded, an older release's files imported), run `action` on it, close it."""

    async def main() -> T:
        db = await prepare(db_url(home()), home())
        try:
            return await action(db)
        finally:
            await db.close()

    return asyncio.run(main())
