"""Helpers shared by the CLI commands: data directory option, JSON output, and the one way commands fail.

Every command is a `Command` or `Group` (below), which turns any error into one report:

    without --json   `error: <message>` on stderr
    with --json      the API's error object {"code": <HTTP status>, "message": <str>} on stdout, nothing on
                     stderr (with --json the error is the data); an error answer from a KeepState server is
                     passed through exactly as the server sent it

and exits with one of the documented exit codes (EXIT_*; `keepstate --help` lists them). Usage errors found
while parsing the command line (unknown option, malformed value) exit 2; without --json click prints them with
the command's usage line.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from keepstate.config import home
from keepstate.errors import BadRequest, KeepStateError, NotFound

F = TypeVar("F", bound=Callable[..., Any])

EXIT_PROBLEMS = 1  # the command ran and found a problem: verification failed, corrupt data, mismatches
EXIT_USAGE = 2  # bad usage, or a request the server refused as malformed (400)
EXIT_NOT_FOUND = 3  # no such sandbox, session, checkpoint, key, template, store or file (404)
EXIT_FAILED = 4  # any other failure: server unreachable or failing, store locked, I/O error

EXIT_CODES_HELP = """\b
Errors and exit codes (every command):
  0  success
  1  the command ran and found a problem: verification failed, corrupt data, mismatches, a replay diverged
  2  bad usage: unknown option, malformed value, a request the server refused as invalid (HTTP 400)
  3  not found: no such sandbox, session, checkpoint, key, template, store or file (HTTP 404)
  4  any other failure: server unreachable or failing, store locked, I/O error, damaged archive
  `keepstate sandbox exec` exits with the command's own exit code once the command runs.

\b
An error prints `error: MESSAGE` on stderr (a usage error, click's usage message). With --json it prints
the API's error object on stdout instead, and nothing on stderr: {"code": HTTP_STATUS, "message": "..."};
an error answer from the server is passed through as the server sent it."""

_JSON = "keepstate.json"  # ctx.meta key: --json was given somewhere on the command line


def home_option(f: F) -> F:
    def set_home(ctx: click.Context, param: click.Parameter, value: str | None) -> Path:
        if value:
            os.environ["KEEPSTATE_HOME"] = value
        return home()

    return click.option("--home", "home_dir", envvar="KEEPSTATE_HOME", callback=set_home, expose_value=False,
                        help="Data directory (default /var/lib/keepstate).")(f)


def json_option(help: str = "Print JSON on stdout (errors too, as {\"code\", \"message\"}).") -> Callable[[F], F]:
    """`--json` (as `as_json`); every command's --json is this one, so that its errors are JSON too."""

    def remember(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
        if value:
            ctx.meta[_JSON] = True
        return value

    return click.option("--json", "as_json", is_flag=True, callback=remember, help=help)


def emit_json(value: Any, *, sort_keys: bool = False) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=sort_keys, default=str))


class RemoteError(KeepStateError):
    """An error answer of a KeepState server; `body()` is the server's JSON, unchanged."""

    def __init__(self, status: int, body: dict[str, object], context: str = "") -> None:
        message = str(body.get("message", "")) or f"HTTP {status}"
        super().__init__(f"{message} ({context}: HTTP {status})" if context else message)
        self.status = status
        self._body = body

    def body(self) -> dict[str, object]:
        return self._body


def exit_code(status: int) -> int:
    """The exit code for an error with this HTTP status."""
    return {400: EXIT_USAGE, 404: EXIT_NOT_FOUND}.get(status, EXIT_FAILED)


def report(error: KeepStateError, as_json: bool, code: int | None = None) -> NoReturn:
    """Print `error` the one way (see the module docstring) and exit."""
    if as_json:
        emit_json(error.body())
    else:
        click.echo(f"error: {error.message}", err=True)
    sys.exit(exit_code(error.status) if code is None else code)


def _as_error(exc: Exception) -> tuple[KeepStateError, int | None] | None:
    """What the CLI reports for an exception (and its exit code if not the status's), or None to let it through."""
    if isinstance(exc, KeepStateError):
        return exc, None
    # Only a command that loaded the store can raise its errors: don't import it (and its dependencies) otherwise.
    store_errors = sys.modules.get("keepstate.store.errors")
    if store_errors is not None and isinstance(exc, store_errors.StoreError):
        if isinstance(exc, store_errors.CorruptObject):
            return KeepStateError(str(exc)), EXIT_PROBLEMS
        if isinstance(exc, (store_errors.CheckpointNotFound, store_errors.RepositoryError)):
            return NotFound(str(exc)), None
        return KeepStateError(str(exc)), None
    if isinstance(exc, FileNotFoundError):
        return NotFound(str(exc)), None
    if isinstance(exc, OSError) and not isinstance(exc, BrokenPipeError):
        return KeepStateError(str(exc)), None
    return None


class _Reporting:
    """Mix-in for click commands: errors become one report and a documented exit code."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        given = args[: args.index("--")] if "--" in args else list(args)  # the parser consumes `args`
        try:
            parsed: list[str] = super().parse_args(ctx, args)  # type: ignore[misc]
            return parsed
        except click.UsageError as exc:
            if ctx.meta.get(_JSON) or "--json" in given:
                report(BadRequest(f"{exc.format_message()} (see `{ctx.command_path} --help`)"), True, exc.exit_code)
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)  # type: ignore[misc]
        except click.UsageError as exc:
            if ctx.meta.get(_JSON):
                report(BadRequest(exc.format_message()), True, exc.exit_code)
            raise
        except click.ClickException as exc:
            report(KeepStateError(exc.format_message()), bool(ctx.meta.get(_JSON)), exc.exit_code)
        except Exception as exc:
            found = _as_error(exc)
            if found is None:
                raise
            report(found[0], bool(ctx.meta.get(_JSON)), found[1])


class Command(_Reporting, click.Command):
    pass


class Group(_Reporting, click.Group):
    command_class = Command
    group_class = type  # subgroups are of this class too
