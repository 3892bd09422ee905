"""`keepstate template`: list and build sandbox templates."""

from __future__ import annotations

import time

import click

from .common import Group, emit_json, home_option, json_option


@click.group(cls=Group)
def template() -> None:
    """List and build sandbox templates (definitions: keepstate/template/definitions/, or $KEEPSTATE_TEMPLATES).

    \b
    Examples:
      keepstate template ls
      keepstate template build base
      keepstate template build code-interpreter-v1 --force
    """


@template.command("ls")
@json_option()
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
        at = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(str(r["built_at"])))) if r["built_at"] else "-"
        digest = str(r["digest"])[:16] if r["digest"] else "-"
        click.echo(f"{r['name']:<22} {'yes' if r['built'] else 'no':<6} {digest:<18} {r['cpu']:>4} "
                   f"{r['memory_mb']:>7}  {at}")


@template.command("build")
@click.argument("name")
@click.option("--force", is_flag=True, help="Rebuild even if the current definition is built.")
@home_option
def build(name: str, force: bool) -> None:
    """Build template NAME (cached: only rebuilt when its definition changes), and the agent runtime every
    sandbox runs its agent on (docs/design/agent-runtime.md), if this host has none yet."""
    from keepstate.runtime.agent_runtime import ensure
    from keepstate.template.builder import ensure_built, stderr_progress

    b = ensure_built(name, force=force)
    ensure(stderr_progress)
    click.echo(f"{b.name} {b.digest}")
