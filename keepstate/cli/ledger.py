"""`keepstate ledger`: show and reconcile the model-call ledger."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

import click

from keepstate.errors import BadRequest, KeepStateError, NotFound

from .common import EXIT_PROBLEMS, Group, json_option


def _open(home: Path | None, config_path: Path | None) -> Any:
    from keepstate.gateway import ConfigError, GatewayConfig
    from keepstate.gateway.prices import PriceTable, PriceTableError
    from keepstate.gateway.store import Store, StoreError

    try:
        cfg = GatewayConfig.from_file(config_path) if config_path else GatewayConfig()
    except ConfigError as exc:
        raise BadRequest(str(exc)) from exc
    if home is not None:
        cfg.data_dir = home
    if not cfg.db_path.exists():
        raise NotFound(f"no gateway ledger at {cfg.db_path} (set --home or $KEEPSTATE_HOME)")
    try:
        return cfg, Store(cfg.db_path), PriceTable.load(cfg.price_table)
    except PriceTableError as exc:
        raise BadRequest(str(exc)) from exc
    except StoreError as exc:
        raise KeepStateError(str(exc)) from exc


_home = click.option("--home", type=click.Path(file_okay=False, path_type=Path), envvar="KEEPSTATE_HOME",
                     help="Data directory (default $KEEPSTATE_HOME or /var/lib/keepstate).")
_config = click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                       help="Gateway config: price table override and providers' stats URLs.")


@click.group(cls=Group, invoke_without_command=True)
@click.option("--session", "session_id", help="Only this session's entries.")
@json_option(help="Print JSON: {entries, totals} (errors as {\"code\", \"message\"}).")
@_home
@_config
@click.pass_context
def ledger(ctx: click.Context, session_id: str | None, as_json: bool, home: Path | None,
           config_path: Path | None) -> None:
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

    _, store, _ = _open(home, config_path)
    entries = store.entries(session_id)
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
def reconcile(as_json: bool, home: Path | None, config_path: Path | None) -> None:
    """Check the ledger against the stored responses, the budgets and the providers' own counts.

    Exit codes: 0 clean, 1 mismatches found (each is printed), 3 no ledger, 4 other failure (`keepstate --help`).
    """
    from keepstate.gateway.ledger import reconcile as run_reconcile

    cfg, store, prices = _open(home, config_path)
    counts: dict[str, dict[str, Any]] = {}
    for p in cfg.providers:
        if p.stats_url:
            try:
                with urllib.request.urlopen(p.stats_url, timeout=10) as r:  # noqa: S310 (configured by the operator)
                    counts[p.name] = json.load(r)
            except OSError as e:
                click.echo(f"warning: provider {p.name}: cannot read {p.stats_url}: {e}", err=True)
    found = run_reconcile(store, prices, counts)
    if as_json:
        click.echo(json.dumps([m.to_dict() for m in found], indent=2))
    else:
        for m in found:
            click.echo(f"MISMATCH {m.check}: {m.subject}: {m.detail}")
        click.echo("ledger reconciled: clean" if not found else f"{len(found)} mismatches", err=True)
    sys.exit(EXIT_PROBLEMS if found else 0)
