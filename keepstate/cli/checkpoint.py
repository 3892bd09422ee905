"""`keepstate checkpoint`: list, verify, export and import checkpoints."""

from __future__ import annotations

import os
import sys
from typing import IO, Any

import click

from keepstate.cli._store_common import emit_json, human_bytes, json_option, open_repo, store_option
from keepstate.cli.common import EXIT_PROBLEMS, Group


@click.group(cls=Group)
def checkpoint() -> None:
    """List, verify, export and import checkpoints.

    \b
    Examples:
      keepstate checkpoint ls --json
      keepstate checkpoint verify 01J9Z3K8W6Y2T5R0M4N7P1Q3S6
      keepstate checkpoint export 01J9Z3K8W6Y2T5R0M4N7P1Q3S6 session.ksx
      keepstate checkpoint import session.ksx --store file:///srv/other/store

    Exit codes: 0 ok, 1 corrupt or problems found, 2 bad usage, 3 not found, 4 other failure
    (`keepstate --help`); with --json an error is {"code", "message"} on stdout.
    """


@checkpoint.command("ls")
@store_option
@json_option()
@click.option("--session", "session_id", metavar="ID", help="Only checkpoints of this session.")
def ls(store_url: str | None, as_json: bool, session_id: str | None) -> None:
    """List checkpoints, oldest first."""
    manifests = [m for m in open_repo(store_url).list_checkpoints()
                 if session_id is None or m.meta.session_id == session_id]
    if as_json:
        emit_json([m.to_json() for m in manifests])
        return
    if not manifests:
        click.echo("no checkpoints", err=True)
        return
    click.echo(f"{'CHECKPOINT':<28} {'SESSION':<20} {'PARENT':<28} {'SIZE':>10} {'ADDED':>10}  CREATED")
    for m in manifests:
        click.echo(f"{m.checkpoint_id:<28} {m.meta.session_id[:20]:<20} {(m.parent_id or '-'):<28} "
                   f"{human_bytes(m.size):>10} {human_bytes(m.meta.stats.get('added_bytes', 0)):>10}  "
                   f"{m.meta.created}")


@checkpoint.command("verify")
@click.argument("checkpoint_id")
@store_option
@json_option()
def verify_cmd(checkpoint_id: str, store_url: str | None, as_json: bool) -> None:
    """Check everything a restore of CHECKPOINT_ID would read: ref, manifest, index and every chunk."""
    from keepstate.store.verify import format_report

    report = open_repo(store_url).verify(checkpoint_id)
    if as_json:
        emit_json(report.to_json())
    else:
        click.echo(format_report(report))
    if not report.ok:
        sys.exit(EXIT_PROBLEMS)


class _Bar:
    """A click progress bar on stderr whose length is learnt from the first progress report."""

    def __init__(self, label: str) -> None:
        self.bar: Any = click.progressbar(length=1, label=label, file=sys.stderr, show_pos=False,
                                          show_percent=True)
        self.started = False

    def __call__(self, advance: int, total: int) -> None:
        if not self.started:
            self.bar.__enter__()
            self.started = True
        self.bar.length = max(total, 1)
        self.bar.update(advance)

    def close(self) -> None:
        if self.started:
            self.bar.__exit__(None, None, None)


@checkpoint.command()
@click.argument("checkpoint_id")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@store_option
@json_option()
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def export(checkpoint_id: str, file: str, store_url: str | None, as_json: bool, quiet: bool) -> None:
    """Write CHECKPOINT_ID to FILE ('-' for stdout) as one portable, self-verifying archive holding every chunk
    it needs; `keepstate checkpoint import` restores it on any other store."""
    repo = open_repo(store_url)
    manifest = repo.get_manifest(checkpoint_id)
    bar = _Bar(f"exporting {checkpoint_id}") if not quiet and file != "-" else None
    tmp = f"{file}.partial"
    try:
        if file == "-":
            repo.export_checkpoint(checkpoint_id, sys.stdout.buffer, bar)
        else:
            with open(tmp, "wb") as out:
                repo.export_checkpoint(checkpoint_id, out, bar)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, file)  # no half-written archive under the final name
    finally:
        if bar is not None:
            bar.close()
        if file != "-" and os.path.exists(tmp):
            os.unlink(tmp)
    if file != "-":
        size = os.path.getsize(file)
        if as_json:
            emit_json({"checkpoint_id": checkpoint_id, "file": file, "bytes": size, "manifest_id": manifest.id})
        else:
            click.echo(f"exported {checkpoint_id} to {file} ({human_bytes(size)})", err=True)


@checkpoint.command("import")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@store_option
@json_option()
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def import_cmd(file: str, store_url: str | None, as_json: bool, quiet: bool) -> None:
    """Import an archive written by `keepstate checkpoint export` ('-' reads stdin). Every chunk is verified
    before the checkpoint is published; the store is created if it does not exist."""
    repo = open_repo(store_url, create=True)
    bar = _Bar(f"importing {file}") if not quiet and file != "-" else None
    try:
        inp: IO[bytes]
        if file == "-":
            manifest = repo.import_checkpoint(sys.stdin.buffer, bar)
        else:
            with open(file, "rb") as inp:
                manifest = repo.import_checkpoint(inp, bar)
    finally:
        if bar is not None:
            bar.close()
    if as_json:
        emit_json(manifest.to_json())
    else:
        click.echo(manifest.checkpoint_id)
        click.echo(f"imported checkpoint {manifest.checkpoint_id} ({human_bytes(manifest.size)})", err=True)
