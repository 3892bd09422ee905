"""`keepstate events`, run as a real process."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from keepstate.db import migrate
from keepstate.db.engine import Database
from keepstate.db.url import default_url
from keepstate.session import EventLog, EventRef, Lineage


def ks(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # Other tests in this worker may have pointed E2B_* at a live server (or KEEPSTATE_DB at a database); this CLI
    # must not see one.
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_") and k != "KEEPSTATE_DB"}
    env["KEEPSTATE_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "keepstate.cli.main", "events", *args], capture_output=True,
                          text=True, env=env, timeout=60)


async def fill(url: str) -> None:
    db = await Database.open(url)
    try:
        await migrate.upgrade(db)
        log = EventLog(db)
        await log.append("isess1", "sandbox.create", {"template_id": "base", "metadata": {"k": "v"}})
        await log.append("isess1", "process.start",
                         {"pid": 4, "cmd": "/bin/bash", "args": ["-c", "echo " + "x" * 100]})
        cp = await log.append("isess1", "checkpoint", {"checkpoint_id": "cp1", "parent_id": None, "kind": "snapshot"})
        await log.start_fork("ichild", "isess1", "cp1", EventRef(cp.seq, cp.hash))
        lineage = Lineage(log.history)
        await lineage.record_session("isess1", "base")
        await lineage.record_checkpoint("cp1", "isess1", None, "snapshot", EventRef(cp.seq, cp.hash))
        await lineage.record_session("ichild", "base", parent_session="isess1", parent_checkpoint_id="cp1")
    finally:
        await db.close()


@pytest.fixture
async def home(tmp_path: Path) -> Path:
    await fill(default_url(tmp_path))  # the database a command uses by default: <home>/keepstate.sqlite
    return tmp_path


def test_table_json_and_after(home: Path) -> None:
    table = ks(home, "isess1")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["SEQ", "TIME", "KIND"] and len(lines) == 5
    assert "sandbox.create" in lines[1] and "…" in lines[2]
    as_json = json.loads(ks(home, "isess1", "--json", "--after", "2").stdout)
    assert [e["seq"] for e in as_json] == [3, 4] and as_json[1]["kind"] == "fork.child"
    assert len(as_json[0]["hash"]) == 64


def test_verify_exit_codes(home: Path) -> None:
    ok = ks(home, "isess1", "--verify")
    assert ok.returncode == 0 and "4 events" in ok.stdout
    assert json.loads(ks(home, "ichild", "--verify", "--json").stdout)["ok"] is True
    con = sqlite3.connect(home / "keepstate.sqlite")
    con.execute("UPDATE events SET data='{\"template_id\":\"evil\"}' WHERE session_id='isess1' AND seq=1")
    con.commit()
    con.close()
    bad = ks(home, "isess1", "--verify")
    assert bad.returncode == 1 and "seq 1" in bad.stderr
    assert json.loads(ks(home, "isess1", "--verify", "--json").stdout)["first_bad_seq"] == 1


def test_lineage_and_unknown_session(home: Path) -> None:
    tree = json.loads(ks(home, "ichild", "--lineage").stdout)
    assert tree["root"]["checkpoints"][0]["forks"][0]["sessionId"] == "ichild"
    missing = ks(home, "nobody")
    assert missing.returncode == 3 and "error: no events" in missing.stderr
    no_server = ks(home, "isess1", "--replay")
    assert no_server.returncode == 2 and "--api-url" in no_server.stderr


async def test_db_option_names_another_database(tmp_path: Path, db_url: str) -> None:
    """--db (or KEEPSTATE_DB) instead of the data directory's own database: SQLite or PostgreSQL."""
    await fill(db_url)
    empty_home = tmp_path / "empty"
    assert ks(empty_home, "isess1").returncode == 3  # the home's own (new, empty) database has no such session
    ok = ks(empty_home, "isess1", "--verify", "--db", db_url)
    assert ok.returncode == 0 and "4 events" in ok.stdout, ok.stderr
    tree = json.loads(ks(empty_home, "ichild", "--lineage", "--db", db_url).stdout)
    assert tree["rootSessionId"] == "isess1"
