"""`keepstate keys`: API keys for the control plane (sent by SDKs as X-API-KEY)."""

from __future__ import annotations

import dataclasses
import time

import click

from keepstate.apikeys import API_KEY_FORMAT, find, issue
from keepstate.config import home
from keepstate.db.repos import Keys
from keepstate.errors import BadRequest, NotFound

from .common import Group, emit_json, home_option, json_option
from .database import db_option, run

DEV_KEY_FILE = "dev-api-key"


@click.group(cls=Group)
def keys() -> None:
    """Create, list and revoke API keys.

    \b
    Examples:
      keepstate keys create ci-runner     # prints the key once; store it
      keepstate keys create ci --max-sandboxes 10   # at most 10 running sandboxes at once
      keepstate keys limit ci 20          # change it (0: unlimited; `default`: the server's)
      keepstate keys ls --json
      keepstate keys revoke key_1a2b3c4d5e6f
    """


@keys.command("create")
@click.argument("name")
@click.option("--max-sandboxes", type=click.IntRange(min=0), default=None,
              help="Running sandboxes this key may have at once (0: unlimited); default: the server's "
                   "--max-sandboxes-per-key.")
@home_option
@db_option
def create(name: str, max_sandboxes: int | None) -> None:
    """Create a key called NAME and print it (it is shown only this once)."""
    key, secret = run(lambda db: issue(Keys(db), name, max_sandboxes))
    click.echo(secret)
    click.echo(f"created {key.id} ({name}); export E2B_API_KEY={secret}", err=True)


@keys.command("limit")
@click.argument("key")
@click.argument("max_sandboxes")
@home_option
@db_option
def limit(key: str, max_sandboxes: str) -> None:
    """Set how many running sandboxes the key KEY (its name or ID) may have at once: a number (0: unlimited) or
    `default` (the server's --max-sandboxes-per-key). Servers apply it from their next create on."""
    if max_sandboxes == "default":
        value = None
    elif max_sandboxes.isdecimal():
        value = int(max_sandboxes)
    else:
        raise BadRequest(f"MAX_SANDBOXES must be a whole number (0: unlimited) or `default`, not {max_sandboxes!r}")
    found = [k for k in run(lambda db: Keys(db).list()) if k.revoked_at is None and key in (k.id, k.name)]
    if not found:
        raise NotFound(f"no active key named or with id {key!r}; see `keepstate keys ls`")
    if len(found) > 1:
        raise BadRequest(f"{len(found)} active keys are named {key!r}: name one by its ID (`keepstate keys ls`)")
    run(lambda db: Keys(db).set_limit(found[0].id, value))
    shown = "the server's default" if value is None else "unlimited" if value == 0 else str(value)
    click.echo(f"{found[0].id} ({found[0].name}): at most {shown} running sandboxes", err=True)


@keys.command("ls")
@json_option()
@home_option
@db_option
def ls(as_json: bool) -> None:
    """List keys (never their secrets)."""
    rows = run(lambda db: Keys(db).list())
    if as_json:
        emit_json([dataclasses.asdict(k) for k in rows])
        return
    click.echo(f"{'ID':<18} {'NAME':<20} {'PREFIX':<8} {'CREATED':<20} {'MAX':<10} STATUS")
    for k in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(k.created_at))
        most = "default" if k.max_sandboxes is None else "unlimited" if k.max_sandboxes == 0 else str(k.max_sandboxes)
        click.echo(f"{k.id:<18} {k.name:<20} {k.prefix:<8} {created:<20} {most:<10} "
                   f"{'revoked' if k.revoked_at else 'active'}")


@keys.command("revoke")
@click.argument("key_id")
@home_option
@db_option
def revoke(key_id: str) -> None:
    """Revoke the key KEY_ID (its ID, or the name of one active key; see `keepstate keys ls`)."""
    if not run(lambda db: Keys(db).revoke(key_id)):
        raise NotFound(f"no active key with id {key_id}; see `keepstate keys ls`")
    click.echo(f"revoked {key_id}", err=True)


@keys.command("dev")
@home_option
@db_option
def dev() -> None:
    """Print the development key, creating it on first use (used by `make up`)."""
    path = home() / DEV_KEY_FILE
    if path.exists():
        secret = path.read_text().strip()
        # an older dev key in our old format is replaced
        if API_KEY_FORMAT.match(secret) and run(lambda db: find(Keys(db), secret)):
            click.echo(secret)
            return
    _, secret = run(lambda db: issue(Keys(db), "development"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(secret + "\n")
    path.chmod(0o600)
    click.echo(secret)
