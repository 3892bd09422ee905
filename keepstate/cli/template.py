"""`keepstate template`: list and build sandbox templates."""

from __future__ import annotations

import time

import click

from keepstate.errors import KeepStateError

from .common import emit_json, fail, home_option


@click.group()
def template() -> None:
    """List and build sandbox templates (definitions in the repo's templates/ folder).

    \b
    Examples:
      keepstate template ls
      keepstate template build base
      keepstate template build code-interpreter-v1 --force
    """


@template.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@home_option
def ls(as_json: bool) -> None:
    """List templates, whether they are built, and their digests."""
    from keepstate.template.builder import list_built

    rows = list_built()
    if as_json:
        emit_json(rows)
        return
    click.echo(f"{'NAME':<22} {'BUILT':<6} {'DIGEST':<18} {'CPU':>4} {'MEM MB':>7}  BUILT AT")
    for r in rows:
        at = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["built_at"])) if r["built_at"] else "-"
        digest = str(r["digest"])[:16] if r["digest"] else "-"
        click.echo(f"{r['name']:<22} {'yes' if r['built'] else 'no':<6} {digest:<18} {r['cpu']:>4} "
                   f"{r['memory_mb']:>7}  {at}")


@template.command("build")
@click.argument("name")
@click.option("--force", is_flag=True, help="Rebuild even if the current definition is built.")
@home_option
def build(name: str, force: bool) -> None:
    """Build template NAME (cached: only rebuilt when its definition changes)."""
    from keepstate.template.builder import ensure_built

    try:
        b = ensure_built(name, force=force)
    except KeepStateError as exc:
        fail(exc.message)
        return
    click.echo(f"{b.name} {b.digest}")
