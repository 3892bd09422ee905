"""`kill -9` of a server on PostgreSQL, then a new server on the same database and data directory: it adopts the
running sandbox (its processes still counting) and the paused one's frozen standby, as on SQLite (test_crash.py)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest
from e2b import Sandbox

from keepstate.testing.databases import require_postgres
from keepstate.testing.postgres import PostgresServer
from tests.sdk.sdkharness import KEEPSTATE, Server, wait_until

from .conftest import Fleet, keepstate_env, sdk_opts
from .test_crash import count, counting


def resumed_from(srv: Server, db: str, sandbox_id: str) -> list[str]:
    """Where each resume came from, read by `keepstate events` on the server's database."""
    out = subprocess.run([str(KEEPSTATE), "events", sandbox_id, "--json"], capture_output=True, text=True,
                         env={**keepstate_env(srv), "KEEPSTATE_DB": db}, timeout=300, check=True).stdout
    events = json.loads(out)
    events = events["events"] if isinstance(events, dict) else events
    return [e["data"]["from"] for e in events if e["kind"] == "sandbox.resume"]


@pytest.fixture
def pg() -> Iterator[PostgresServer]:
    require_postgres()
    with PostgresServer() as server:
        yield server


def test_sigkill_of_a_server_on_postgres_adopts_its_sandboxes(fleet: Fleet, pg: PostgresServer) -> None:
    db = pg.createdb("crash")
    srv = fleet.start(db=db)
    opts = sdk_opts(srv)
    running = Sandbox.create(timeout=300, **opts)
    counting(running)
    running.files.write("/home/user/f.txt", "running")
    paused = Sandbox.create(timeout=300, **opts)
    paused.files.write("/home/user/f.txt", "paused")
    paused.pause()
    before = count(running)
    port = int(srv.url.rsplit(":", 1)[1])
    fleet.sigkill(srv)

    srv2 = fleet.start(home=srv.home, port=port, db=db)
    opts2 = sdk_opts(srv2)
    assert {s.sandbox_id: s.state.value for s in Sandbox.list(**opts2).next_items()} == {
        running.sandbox_id: "running", paused.sandbox_id: "paused"}
    again = Sandbox.connect(running.sandbox_id, **opts2)
    assert again.files.read("/home/user/f.txt") == "running"
    wait_until(lambda: count(again) > before, 30, f"the adopted counter to go on past {before}")
    thawed = Sandbox.connect(paused.sandbox_id, **opts2)
    assert thawed.files.read("/home/user/f.txt") == "paused"
    assert resumed_from(srv2, db, paused.sandbox_id) == ["standby"]  # the standby outlived the server, adopted
    again.kill()
    thawed.kill()
