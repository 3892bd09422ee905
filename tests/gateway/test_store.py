"""The data-access module on a real SQLite file: budgets under contention, recovery after a dead gateway."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from keepstate.gateway.ledger import reconcile
from keepstate.gateway.prices import PriceTable
from keepstate.gateway.store import Attempt, BudgetRefused, Run, Store, StoreError

RUN = Run("run_1", "sess", "sbx", "key", None, "diverge", None, False)


def attempt(key: str) -> Attempt:
    return Attempt(key, RUN, "p", "gpt-4o", "chat", time.time())


def dead_owner() -> str:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return f"{proc.stdout.strip()}:deadbeef"


def test_reservations_refuse_before_overrun_across_connections(tmp_path: Path) -> None:
    a, b = Store(tmp_path / "g.sqlite"), Store(tmp_path / "g.sqlite")
    a.create_run(RUN, "h")
    a.set_budget("session", "sess", 100)
    a.begin_upstream(attempt("k1"), False, "h1", None, [("session", "sess")], 60)
    with pytest.raises(BudgetRefused):
        b.begin_upstream(attempt("k2"), False, "h2", None, [("session", "sess")], 60)
    assert b.call("k2") is None  # nothing written for the refused call
    a.finish_upstream(attempt("k1"), ok=True, outcome="ok", http_status=200, content_type="application/json",
                      response=b"{}", usage=None, request_id=None, cost_nano=10, priced=True)
    b.begin_upstream(attempt("k2"), False, "h2", None, [("session", "sess")], 60)
    (budget,) = b.budgets()
    assert (budget["spent_nano"], budget["reserved_nano"]) == (10, 60)


def test_recover_marks_dead_gateways_calls_interrupted(tmp_path: Path) -> None:
    dead = Store(tmp_path / "g.sqlite", owner=dead_owner())
    dead.create_run(RUN, "h")
    dead.set_budget("key", "key", 1000)
    dead.begin_upstream(attempt("k1"), True, "h1", None, [("key", "key")], 300)
    alive = Store(tmp_path / "g.sqlite")
    assert alive.recover() == ["k1"]
    call = alive.call("k1")
    assert call is not None and call.status == "interrupted"
    (entry,) = alive.entries()
    assert (entry["kind"], entry["outcome"]) == ("upstream", "interrupted")
    (budget,) = alive.budgets()
    assert (budget["spent_nano"], budget["reserved_nano"]) == (300, 0)  # the provider may have billed it
    found = reconcile(alive, PriceTable.load())
    assert [m.check for m in found] == ["outcome"]
    assert alive.recover() == []


def test_schema_version_is_checked(tmp_path: Path) -> None:
    s = Store(tmp_path / "g.sqlite")
    s.db.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    s.close()
    with pytest.raises(StoreError, match="schema version 99"):
        Store(tmp_path / "g.sqlite")


def test_a_version_1_file_is_migrated(tmp_path: Path) -> None:
    s = Store(tmp_path / "g.sqlite")
    s.create_run(RUN, "h")
    # back to what a version 1 gateway wrote: no bindings, no times, no alignment
    for table, column in (("runs", "aligned_at"), ("runs", "source_ip"), ("marks", "last_position"),
                          ("positions", "arrived_at"), ("positions", "delivered_at")):
        s.db.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    s.db.execute("DROP TABLE bindings")
    s.db.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
    s.close()
    migrated = Store(tmp_path / "g.sqlite")
    version = migrated.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0]
    assert version == "2"
    assert migrated.run("run_1") == RUN
    migrated.create_run(Run("run_2", "sess", "sbx", None, None, "diverge", None, False, None, "10.88.0.6"), "h2",
                        "10.88.0.6")
    bound = migrated.bound_run("10.88.0.6")
    assert bound is not None and bound.run_id == "run_2" and bound.source_ip == "10.88.0.6"


def test_binding_follows_the_latest_registration_and_ends_with_its_run(tmp_path: Path) -> None:
    s = Store(tmp_path / "g.sqlite")
    s.create_run(Run("a", "s1", "x", None, None, "diverge", None, False), "ha", "10.88.0.2")
    s.create_run(Run("b", "s2", "y", None, None, "diverge", None, False), "hb", "10.88.0.2")
    assert s.bindings() == {"10.88.0.2": "b"}
    s.end_run("a")  # ending a superseded run leaves the address to its new owner
    assert s.bindings() == {"10.88.0.2": "b"}
    s.end_run("b")
    assert s.bindings() == {} and s.bound_run("10.88.0.2") is None
