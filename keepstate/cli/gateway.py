"""`keepstate gateway`: run the metering gateway alone."""

from __future__ import annotations

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
def gateway(listen: str, config_path: Path | None, home: Path | None) -> None:
    """Run the model-call metering gateway alone.

    \b
    Example:
      keepstate gateway --listen 127.0.0.1:3100 --config /etc/keepstate/gateway.toml

    Sandboxes reach it with the OPENAI_*/ANTHROPIC_* variables that the server gives them; the gateway shares
    $KEEPSTATE_HOME/gateway.sqlite with the server and with `keepstate ledger`.
    """
    from aiohttp import web

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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    web.run_app(create_app(cfg), host=host.strip("[]"), port=int(port), access_log=None,
                print=lambda msg: click.echo(f"keepstate gateway on http://{listen} (data: {cfg.data_dir})", err=True))
