"""`keepstate events`: read, verify and replay a session's causal history."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click

from keepstate.db.engine import Database
from keepstate.errors import BadRequest, NotFound
from keepstate.session import Event, EventLog, Lineage, Replayer, VerifyResult

from .common import EXIT_PROBLEMS, Command, emit_json, home_option, json_option
from .database import db_option, run


def _short(data: dict[str, Any], width: int = 60) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text if len(text) <= width else text[: width - 1] + "…"


def _table(events: list[Event]) -> None:
    click.echo(f"{'SEQ':>5}  {'TIME':<23}  {'KIND':<20}  {'HASH':<12}  DATA")
    for ev in events:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ev.ts)) + f".{int(ev.ts % 1 * 1000):03d}"
        click.echo(f"{ev.seq:>5}  {when:<23}  {ev.kind:<20}  {ev.hash[:12]}  {_short(ev.data)}")


@click.command(cls=Command)
@click.argument("session_id")
@click.option("--verify", "do_verify", is_flag=True, help="Recompute every hash and link; exit 1 if any is wrong.")
@json_option(help="Print JSON (events exactly as they are hashed; errors as {\"code\", \"message\"}).")
@click.option("--after", type=click.IntRange(min=0), default=0, show_default=True, help="Only events after this seq.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most this many events.")
@click.option("--lineage", "show_lineage", is_flag=True, help="Print the session's lineage tree (JSON) instead.")
@click.option("--replay", "do_replay", is_flag=True,
              help="Replay the causal history in a fresh sandbox on a live server (needs --api-url, --api-key).")
@click.option("--api-url", envvar="E2B_API_URL", help="Server to replay on (default $E2B_API_URL).")
@click.option("--api-key", envvar="E2B_API_KEY", help="API key for --replay (default $E2B_API_KEY).")
@click.option("--template", help="Template for --replay (default: the one the session was created from).")
@home_option
@db_option
def events(session_id: str, do_verify: bool, as_json: bool, after: int, limit: int | None, show_lineage: bool,
           do_replay: bool, api_url: str | None, api_key: str | None, template: str | None) -> None:
    """Show the causal history of SESSION_ID (a sandbox ID).

    \b
    Examples:
      keepstate events i1a2b3c4d5e6f7                # table: seq, time, kind, short hash, data
      keepstate events i1a2b3c4d5e6f7 --json --after 40
      keepstate events i1a2b3c4d5e6f7 --verify       # exit 0 if the chain verifies, 1 naming the first bad seq
      keepstate events i1a2b3c4d5e6f7 --lineage      # checkpoints and forks
      keepstate events i1a2b3c4d5e6f7 --replay --api-url http://127.0.0.1:3000 --api-key $E2B_API_KEY

    Exit codes: 0 ok, 1 verification failed / replay diverged, 2 usage error, 3 unknown session,
    4 other failure (`keepstate --help`).
    Design: docs/design/causal-history.md.
    """
    if show_lineage:
        emit_json(run(lambda db: Lineage(db).tree(session_id)))
    elif do_verify:
        _verify(run(lambda db: EventLog(db).verify(session_id)), session_id, as_json)
    elif do_replay:
        if not api_url or not api_key:
            raise BadRequest("--replay needs --api-url and --api-key (or $E2B_API_URL and $E2B_API_KEY)")
        _replay(run(lambda db: EventLog(db).causal_history(session_id)), session_id, api_url, api_key, template,
                as_json)
    else:
        async def read(db: Database) -> list[Event]:
            log = EventLog(db)
            evs = await log.read(session_id, after=after, limit=limit)
            if not evs and not await log.exists(session_id):
                raise NotFound(f"no events for session {session_id}; see `keepstate checkpoint ls` for known "
                               "sessions")
            return evs

        evs = run(read)
        if as_json:
            emit_json([e.to_dict() for e in evs])
        else:
            _table(evs)


def _verify(result: VerifyResult, session_id: str, as_json: bool) -> None:
    if as_json:
        emit_json(result.to_dict())
    elif result.ok:
        click.echo(f"ok: {result.checked} events of session {session_id} verify")
    else:
        click.echo(f"FAILED at seq {result.first_bad_seq}: {result.reason} ({result.checked} events verified before "
                   "it)", err=True)
    if not result.ok:
        sys.exit(EXIT_PROBLEMS)


def _replay(history: list[Event], session_id: str, api_url: str, api_key: str, template: str | None,
            as_json: bool) -> None:
    if template is None:
        created = next((e for e in history if e.kind == "sandbox.create"), None)
        template = str(created.data.get("template_id")) if created and created.data.get("template_id") else None
    from keepstate.session.e2b_executor import E2BExecutor

    with E2BExecutor(template, api_url=api_url, api_key=api_key) as executor:
        click.echo(f"replaying {len(history)} events of {session_id} in sandbox {executor.sandbox_id}", err=True)
        report = Replayer(executor).replay(history)
    if as_json:
        emit_json({"sessionId": session_id, **report.to_dict()})
    else:
        for r in report.results:
            click.echo(f"{r.seq:>5}  {r.outcome:<15}  {r.detail}")
        click.echo(", ".join(f"{n} {k}" for k, n in sorted(report.counts().items())) or "nothing to replay", err=True)
    if not report.ok:
        sys.exit(EXIT_PROBLEMS)
