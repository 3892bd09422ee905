"""`keepstate gateway`: run the metering gateway alone."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import click

from keepstate.errors import BadRequest
from keepstate.ports import GATEWAY_PORT

from .common import Command


@click.command(cls=Command)
@click.option("--listen", default=f"127.0.0.1:{GATEWAY_PORT}", show_default=True, help="HOST:PORT to serve on.")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Gateway config (TOML or JSON); format in docs/design/gateway.md.")
@click.option("--home", type=click.Path(file_okay=False, path_type=Path), envvar="KEEPSTATE_HOME",
              help="Data directory (default $KEEPSTATE_HOME or /var/lib/keepstate); overrides the config's data_dir.")
@click.option("--db", "db_url", envvar="KEEPSTATE_DB", metavar="URL",
              help="The database: sqlite:///PATH (default: <data directory>/keepstate.sqlite) or "
                   "postgresql://USER@HOST/NAME (libpq URLs, Unix sockets as ?host=/dir); $KEEPSTATE_DB. "
                   "docs/design/database.md")
def gateway(listen: str, config_path: Path | None, home: Path | None, db_url: str | None) -> None:
    """Run the model-call metering gateway alone.

    \b
    Example:
      keepstate gateway --listen 127.0.0.1:3100 --config /etc/keepstate/gateway.toml

    Sandboxes reach it with the OPENAI_*/ANTHROPIC_* variables that the server gives them; the gateway shares
    the database (--db) with the server and with `keepstate ledger`.
    """
    from aiohttp import web

    from keepstate.db.engine import Database
    from keepstate.db.setup import prepare
    from keepstate.db.url import default_url
    from keepstate.gateway import ConfigError, GatewayConfig, create_app

    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise click.BadParameter(f"expected HOST:PORT, e.g. 127.0.0.1:{GATEWAY_PORT}", param_hint="--listen")
    try:
        cfg = GatewayConfig.from_file(config_path) if config_path else GatewayConfig()
    except ConfigError as e:
        raise BadRequest(str(e)) from e
    if home is not None:
        cfg.data_dir = home
    url = db_url or default_url(cfg.data_dir)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def check() -> str:  # before listening: a bad URL, a database down or too new ends the command here
        db = await prepare(url, Path(cfg.data_dir))
        await db.close()
        return db.url.shown

    shown = asyncio.run(check())

    async def app() -> web.Application:
        db = Database.connect(url)  # on the serving loop; the application does not close it, this does
        application = create_app(cfg, db)

        async def close_db(_: web.Application) -> None:
            await db.close()

        application.on_cleanup.append(close_db)
        return application

    web.run_app(app(), host=host.strip("[]"), port=int(port), access_log=None,
                print=lambda msg: click.echo(f"keepstate gateway on http://{listen} (data: {shown})", err=True))
