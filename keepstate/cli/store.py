"""`keepstate store`: check and garbage-collect the checkpoint store."""

from __future__ import annotations

import sys

import click

from keepstate.cli._store_common import emit_json, human_bytes, json_option, open_repo, store_option
from keepstate.cli.common import EXIT_PROBLEMS, Group


@click.group(cls=Group)
def store() -> None:
    """Verify and garbage-collect the checkpoint store.

    \b
    Examples:
      keepstate store verify                       # check every object (exit 1 if any is damaged)
      keepstate store gc --json                    # reclaim what no checkpoint references
      keepstate store verify --store 's3://bucket/ks?endpoint=http://127.0.0.1:8333'

    Exit codes: 0 ok, 1 problems found, 2 bad usage, 3 store not found, 4 other failure (e.g. locked)
    (`keepstate --help`); with --json an error is {"code", "message"} on stdout.
    The format is specified in docs/design/checkpoint-format.md.
    """


@store.command()
@store_option
@json_option()
def verify(store_url: str | None, as_json: bool) -> None:
    """Check every object: refs, manifests, index objects, and every chunk of every pack."""
    from keepstate.store.verify import format_report

    report = open_repo(store_url).verify()
    if as_json:
        emit_json(report.to_json())
    else:
        click.echo(format_report(report))
    if not report.ok:
        sys.exit(EXIT_PROBLEMS)


@store.command()
@store_option
@json_option()
@click.option("--repack-threshold", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True,
              help="Rewrite a pack when more than this share of it is dead (0 reclaims every dead chunk, "
                   "1 only drops wholly dead packs).")
def gc(store_url: str | None, as_json: bool, repack_threshold: float) -> None:
    """Remove what no checkpoint references: dead packs and chunks, old index objects, leftovers of
    interrupted writes. Needs the store to itself (fails with exit 4 while a writer holds a lock)."""
    report = open_repo(store_url).gc(repack_threshold=repack_threshold)
    if as_json:
        emit_json(report.to_json())
    else:
        click.echo(report.summary())
        click.echo(f"store size: {human_bytes(report.bytes_before)} -> {human_bytes(report.bytes_after)}")
