"""`keepstate ledger`: show and reconcile the model-call ledger."""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from keepstate.errors import BadRequest, NotFound

from .common import EXIT_PROBLEMS, Group, json_option

if TYPE_CHECKING:
    from keepstate.db.engine import Database
    from keepstate.db.repos.ledger import Ledger
    from keepstate.gateway import GatewayConfig
    from keepstate.gateway.ledger import Mismatch
    from keepstate.gateway.prices import PriceTable

T = TypeVar("T")


def _config_of(home: Path | None, config_path: Path | None) -> tuple[GatewayConfig, PriceTable]:
    from keepstate.gateway import ConfigError, GatewayConfig
    from keepstate.gateway.prices import PriceTable, PriceTableError

    try:
        cfg = GatewayConfig.from_file(config_path) if config_path else GatewayConfig()
    except ConfigError as exc:
        raise BadRequest(str(exc)) from exc
    if home is not None:
        cfg.data_dir = home
    try:
        return cfg, PriceTable.load(cfg.price_table)
    except PriceTableError as exc:
        raise BadRequest(str(exc)) from exc


async def _open(url: str, home: Path) -> Database:
    """The database with the ledger, at this release's schema; NotFound if there is none (an SQLite file that does
    not exist, a database keepstate never set up), without creating one."""
    from keepstate.db import legacy, migrate
    from keepstate.db.engine import Database
    from keepstate.db.setup import upgrade
    from keepstate.db.url import parse

    parsed = parse(url)
    to_import = parsed.kind == "sqlite" and bool(legacy.legacy_files(home))
    where = "(set --db, --home, $KEEPSTATE_DB or $KEEPSTATE_HOME)"
    if parsed.path is not None and not parsed.path.exists() and not to_import:
        raise NotFound(f"no gateway ledger at {parsed.shown} {where}")
    db = await Database.open(parsed)
    try:
        if not await migrate.current(db) and not to_import:
            raise NotFound(f"no gateway ledger in {parsed.shown}: keepstate never set this database up {where}")
        await upgrade(db, home)
    except BaseException:
        await db.close()
        raise
    return db


def _with_ledger(db_url: str | None, home: Path, action: Callable[[Ledger], Awaitable[T]]) -> T:
    from keepstate.db.repos.ledger import Ledger
    from keepstate.db.url import default_url
    from keepstate.gateway.owners import process_owner

    async def main() -> T:
        db = await _open(db_url or default_url(home), home)
        try:
            return await action(Ledger(db, process_owner()))
        finally:
            await db.close()

    return asyncio.run(main())


_home = click.option("--home", type=click.Path(file_okay=False, path_type=Path), envvar="KEEPSTATE_HOME",
                     help="Data directory (default $KEEPSTATE_HOME or /var/lib/keepstate).")
_config = click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                       help="Gateway config: price table override and providers' stats URLs.")
_db = click.option("--db", "db_url", envvar="KEEPSTATE_DB", metavar="URL",
                   help="The database: sqlite:///PATH (default: <data directory>/keepstate.sqlite) or "
                        "postgresql://USER@HOST/NAME (libpq URLs, Unix sockets as ?host=/dir); $KEEPSTATE_DB.")


@click.group(cls=Group, invoke_without_command=True)
@click.option("--session", "session_id", help="Only this session's entries.")
@json_option(help="Print JSON: {entries, totals} (errors as {\"code\", \"message\"}).")
@_home
@_config
@_db
@click.pass_context
def ledger(ctx: click.Context, session_id: str | None, as_json: bool, home: Path | None,
           config_path: Path | None, db_url: str | None) -> None:
    """Show the model-call ledger: one entry per upstream call, zero-cost entries for answers from the store.

    \b
    Examples:
      keepstate ledger --session sess_123
      keepstate ledger --json | jq .totals
      keepstate ledger reconcile
    """
    if ctx.invoked_subcommand is not None:
        return
    from keepstate.gateway.ledger import totals

    cfg, _ = _config_of(home, config_path)
    entries = _with_ledger(db_url, Path(cfg.data_dir), lambda ledger: ledger.entries(session_id))
    if as_json:
        click.echo(json.dumps({"entries": entries, "totals": totals(entries)}, indent=2))
        return
    click.echo(f"{'ID':>6} {'KIND':8} {'OUTCOME':11} {'SESSION':14} {'MODEL':20} {'IN':>7} {'OUT':>6} "
               f"{'CACHED':>6} {'COST $':>10} ORIGINAL")
    for e in entries:
        click.echo(f"{e['entry_id']:>6} {e['kind']:8} {e['outcome']:11} {e['session_id'][:14]:14} "
                   f"{e['model'][:20]:20} {e['input_tokens']:>7} {e['output_tokens']:>6} {e['cached_tokens']:>6} "
                   f"{e['cost_nano'] / 1e9:>10.6f} {e['original_entry_id'] or ''}")
    t = totals(entries)
    click.echo(f"{t['upstream_calls']} upstream calls, {t['served_from_store']} answered without one, "
               f"{t['input_tokens']} input / {t['output_tokens']} output tokens, ${t['cost_usd']:.6f}")


@ledger.command()
@json_option(help="Print the mismatches as JSON (errors as {\"code\", \"message\"}).")
@_home
@_config
@_db
def reconcile(as_json: bool, home: Path | None, config_path: Path | None, db_url: str | None) -> None:
    """Check the ledger against the stored responses, the budgets and the providers' own counts.

    Exit codes: 0 clean, 1 mismatches found (each is printed), 3 no ledger, 4 other failure (`keepstate --help`).
    """
    from keepstate.gateway.ledger import reconcile as run_reconcile

    cfg, prices = _config_of(home, config_path)

    def provider_counts() -> dict[str, dict[str, Any]]:
        counts: dict[str, dict[str, Any]] = {}
        for p in cfg.providers:
            if p.stats_url:
                try:
                    with urllib.request.urlopen(p.stats_url, timeout=10) as r:  # noqa: S310 (the operator's URL)
                        counts[p.name] = json.load(r)
                except OSError as e:
                    click.echo(f"warning: provider {p.name}: cannot read {p.stats_url}: {e}", err=True)
        return counts

    async def check(ledger: Ledger) -> list[Mismatch]:  # the ledger found first, then the providers asked
        return await run_reconcile(ledger, prices, await asyncio.to_thread(provider_counts))

    found = _with_ledger(db_url, Path(cfg.data_dir), check)
    if as_json:
        click.echo(json.dumps([m.to_dict() for m in found], indent=2))
    else:
        for m in found:
            click.echo(f"MISMATCH {m.check}: {m.subject}: {m.detail}")
        click.echo("ledger reconciled: clean" if not found else f"{len(found)} mismatches", err=True)
    sys.exit(EXIT_PROBLEMS if found else 0)
