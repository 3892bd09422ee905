"""What `keepstate store` and `keepstate checkpoint` share: the --store option, opening the store, output.

Errors and exit codes are the CLI's (keepstate/cli/common.py): a corrupt object exits 1, an unknown store,
checkpoint or file 3, any other store failure (locked, I/O, damaged archive) 4.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from keepstate import config
from keepstate.cli import common
from keepstate.cli.common import json_option

__all__ = ["default_store_url", "emit_json", "human_bytes", "json_option", "open_repo", "store_option"]

F = TypeVar("F", bound=Callable[..., Any])


def default_store_url() -> str:
    return (config.home() / "store").absolute().as_uri()


def store_option(f: F) -> F:
    return click.option(
        "--store", "store_url", metavar="URL", envvar="KEEPSTATE_STORE", default=None,
        help="Checkpoint store: file:///PATH or s3://BUCKET/PREFIX?endpoint=URL "
             "[env KEEPSTATE_STORE; default file://$KEEPSTATE_HOME/store].")(f)


def open_repo(store_url: str | None, create: bool = False) -> Any:
    from keepstate.store import Repository, backend_from_url

    url = store_url or default_store_url()
    try:
        backend = backend_from_url(url)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--store") from exc
    return Repository.open(backend, create=create)


def emit_json(data: Any) -> None:
    common.emit_json(data, sort_keys=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
