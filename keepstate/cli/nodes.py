"""`keepstate nodes`: the nodes of the cluster that share this database (docs/design/cluster.md)."""

from __future__ import annotations

import click

from keepstate.cluster.view import node_json
from keepstate.db.repos import Nodes
from keepstate.db.repos.nodes import LIVE
from keepstate.errors import NotFound

from .common import Group, emit_json, home_option, json_option
from .database import db_option, run


@click.group(cls=Group)
def nodes() -> None:
    """List, drain and remove the nodes of a cluster.

    \b
    Examples:
      keepstate --db postgresql://keepstate@db.internal/keepstate nodes ls
      keepstate nodes drain host-b      # it takes no more creates; its lease goes on
      keepstate nodes remove host-b     # forget it; if it still runs, it rejoins as a new incarnation
    """


@nodes.command("ls")
@json_option()
@home_option
@db_option
def ls(as_json: bool) -> None:
    """Every node: its state, address, and how long its lease has left by the database's clock."""

    found, now = run(lambda db: Nodes(db).shown())
    shown = [node_json(n, now) for n in found]
    if as_json:
        emit_json(shown)
        return
    if not shown:
        click.echo("no nodes (a server joins when it starts)", err=True)
        return
    click.echo(f"{'NODE':<16} {'STATE':<9} {'INC':>4} {'LEASE':>8}  {'SANDBOXES':>9}  ADDRESS")
    for n in shown:
        lease = f"{n['leaseRemainingSeconds']:.1f}s" if n["state"] in LIVE else "-"
        click.echo(f"{n['nodeID']:<16} {n['state']:<9} {n['incarnation']:>4} {lease:>8}  "
                   f"{n['metrics'].get('sandboxes', '-')!s:>9}  {n['address']}")


@nodes.command("drain")
@click.argument("name")
@home_option
@db_option
def drain(name: str) -> None:
    """The live node NAME takes no more creates (its sandboxes go on; its lease too)."""
    if not run(lambda db: Nodes(db).drain(name)):
        raise NotFound(f"no live node {name!r} (see `keepstate nodes ls`)")
    click.echo(f"node {name} is draining", err=True)


@nodes.command("remove")
@click.argument("name")
@home_option
@db_option
def remove(name: str) -> None:
    """Forget the node NAME; if it is still running, its next renewal is refused and it rejoins anew."""
    if not run(lambda db: Nodes(db).remove(name)):
        raise NotFound(f"no node {name!r} (see `keepstate nodes ls`)")
    click.echo(f"node {name} removed", err=True)
