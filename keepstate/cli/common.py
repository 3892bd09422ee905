"""Helpers shared by the CLI commands: data directory option, JSON output, errors."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from keepstate.config import home
from keepstate.errors import KeepStateError

F = TypeVar("F", bound=Callable[..., Any])


def home_option(f: F) -> F:
    def set_home(ctx: click.Context, param: click.Parameter, value: str | None) -> Path:
        if value:
            os.environ["KEEPSTATE_HOME"] = value
        return home()

    return click.option("--home", "home_dir", envvar="KEEPSTATE_HOME", callback=set_home, expose_value=False,
                        help="Data directory (default /var/lib/keepstate).")(f)


def emit_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


def fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def guard(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except KeepStateError as exc:
        fail(exc.message)
