"""What `keepstate store` and `keepstate checkpoint` share: the --store option, opening, errors and exit codes.

Exit codes: 0 success; 1 verification found problems or a checkpoint is corrupt; 2 bad usage; 3 not found (store,
checkpoint or file); 4 any other store failure (locked, I/O, damaged archive).
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from keepstate import config

F = TypeVar("F", bound=Callable[..., Any])

EXIT_PROBLEMS = 1
EXIT_NOT_FOUND = 3
EXIT_FAILED = 4


def default_store_url() -> str:
    return (config.home() / "store").absolute().as_uri()


def store_option(f: F) -> F:
    return click.option(
        "--store", "store_url", metavar="URL", envvar="KEEPSTATE_STORE", default=None,
        help="Checkpoint store: file:///PATH or s3://BUCKET/PREFIX?endpoint=URL "
             "[env KEEPSTATE_STORE; default file://$KEEPSTATE_HOME/store].")(f)


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout.")(f)


def open_repo(store_url: str | None, create: bool = False) -> Any:
    from keepstate.store import Repository, backend_from_url

    url = store_url or default_store_url()
    try:
        backend = backend_from_url(url)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--store") from exc
    return Repository.open(backend, create=create)


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


def fail(code: str, message: str, exit_code: int, as_json: bool) -> None:
    """Report an error: always on stderr; with --json also as {"error": {...}} on stdout."""
    if as_json:
        emit_json({"error": {"code": code, "message": message}})
    click.echo(f"Error: {message}", err=True)
    sys.exit(exit_code)


def handle_errors(f: F) -> F:
    """Turn store errors into one-line messages and documented exit codes."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from keepstate.store import errors

        as_json = bool(kwargs.get("as_json"))
        try:
            return f(*args, **kwargs)
        except errors.CorruptObject as exc:
            fail("corrupt", str(exc), EXIT_PROBLEMS, as_json)
        except (errors.CheckpointNotFound, errors.RepositoryError, FileNotFoundError) as exc:
            fail("not_found", str(exc), EXIT_NOT_FOUND, as_json)
        except (errors.StoreError, OSError) as exc:
            fail(type(exc).__name__, str(exc), EXIT_FAILED, as_json)

    return wrapper  # type: ignore[return-value]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
