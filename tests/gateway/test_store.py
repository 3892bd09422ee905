"""The gateway's ledger on a real database (SQLite and PostgreSQL): budgets under contention, recovery after a dead
gateway, bindings; and a database newer than this release refused by `keepstate ledger`."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from keepstate.cli.ledger import ledger as ledger_command
from keepstate.db.engine import Database
from keepstate.db.repos.ledger import Attempt, BudgetRefused, Ledger, Run
from keepstate.gateway.ledger import reconcile
from keepstate.gateway.owners import owner_alive, process_owner
from keepstate.gateway.prices import PriceTable

from .conftest import sqlite_database

RUN = Run(run_id="run_1", session_id="sess", sandbox_id="sbx", api_key_id="key", checkpoint_id=None, mode="diverge",
          parent_session_id=None)


def attempt(key: str) -> Attempt:
    return Attempt(call_key=key, run=RUN, provider="p", model="gpt-4o", endpoint="chat", started_at=time.time())


def dead_owner() -> str:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return f"{proc.stdout.strip()}:deadbeef"


def run(run_id: str, session: str, sandbox: str) -> Run:
    return Run(run_id=run_id, session_id=session, sandbox_id=sandbox, api_key_id=None, checkpoint_id=None,
               mode="diverge", parent_session_id=None)


async def test_reservations_refuse_before_overrun_across_connections(database: Database) -> None:
    other = await Database.open(database.url)  # another process's connection
    try:
        a, b = Ledger(database, process_owner()), Ledger(other, process_owner())
        await a.create_run(RUN, "h")
        await a.set_budget("session", "sess", 100)
        await a.begin_upstream(attempt("k1"), False, "h1", None, [("session", "sess")], 60)
        with pytest.raises(BudgetRefused):
            await b.begin_upstream(attempt("k2"), False, "h2", None, [("session", "sess")], 60)
        assert await b.call("k2") is None  # nothing written for the refused call
        await a.finish_upstream(attempt("k1"), ok=True, outcome="ok", http_status=200,
                                content_type="application/json", response=b"{}", usage=None, request_id=None,
                                cost_nano=10, priced=True)
        await b.begin_upstream(attempt("k2"), False, "h2", None, [("session", "sess")], 60)
        (budget,) = await b.budgets()
        assert (budget["spent_nano"], budget["reserved_nano"]) == (10, 60)
    finally:
        await other.close()


async def test_recover_marks_dead_gateways_calls_interrupted(database: Database) -> None:
    dead = Ledger(database, dead_owner())
    await dead.create_run(RUN, "h")
    await dead.set_budget("key", "key", 1000)
    await dead.begin_upstream(attempt("k1"), True, "h1", None, [("key", "key")], 300)
    me = process_owner()
    alive = Ledger(database, me)
    assert await alive.recover(lambda owner: owner_alive(owner, me)) == ["k1"]
    call = await alive.call("k1")
    assert call is not None and call.status == "interrupted"
    (entry,) = await alive.entries()
    assert (entry["kind"], entry["outcome"]) == ("upstream", "interrupted")
    (budget,) = await alive.budgets()
    assert (budget["spent_nano"], budget["reserved_nano"]) == (300, 0)  # the provider may have billed it
    found = await reconcile(alive, PriceTable.load())
    assert [m.check for m in found] == ["outcome"]
    assert await alive.recover(lambda owner: owner_alive(owner, me)) == []


async def test_binding_follows_the_latest_registration_and_ends_with_its_run(database: Database) -> None:
    s = Ledger(database, process_owner())
    await s.create_run(run("a", "s1", "x"), "ha", "10.88.0.2")
    await s.create_run(run("b", "s2", "y"), "hb", "10.88.0.2")
    assert await s.bindings() == {"10.88.0.2": "b"}
    await s.end_run("a")  # ending a superseded run leaves the address to its new owner
    assert await s.bindings() == {"10.88.0.2": "b"}
    await s.end_run("b")
    assert await s.bindings() == {} and await s.bound_run("10.88.0.2") is None


async def test_a_database_newer_than_this_release_is_refused(tmp_path: Path) -> None:
    async with sqlite_database(tmp_path) as db:
        async with db.transaction() as conn:
            await conn.execute(sa.text("UPDATE alembic_version SET version_num = 'f999'"))
    result = await asyncio.to_thread(CliRunner().invoke, ledger_command, ["--home", str(tmp_path)])
    assert result.exit_code == 4 and "at revision f999, newer than this release" in result.stderr


def test_a_database_keepstate_never_set_up_is_no_ledger(db_url: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(ledger_command, ["--db", db_url, "--home", str(tmp_path / "home")])
    assert result.exit_code == 3 and "error: no gateway ledger" in result.stderr
    assert not (tmp_path / "home").exists()  # nothing created by looking
