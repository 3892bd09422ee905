"""`keepstate serve --db`: what a server does with a database it cannot use at start, and with one that goes away
while it serves (docs/design/database.md, "When the database fails"). Real `keepstate serve` processes (the fake
runtime: no sandbox needs gVisor here) on a real PostgreSQL 15 that the test stops and starts again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keepstate.testing.postgres import PostgresServer

sys.path.insert(0, str(Path(__file__).parents[1] / "sdk"))
from sdkharness import KEEPSTATE, free_port, wait_health  # noqa: E402

REQUEST_TIMEOUT = 60  # a bound on each request, so that a hang fails the test instead of stalling it


def serve(home: Path, db: str, port: int | None = None) -> subprocess.Popen[bytes]:
    """A server on the fake runtime, every answer checked against docs/openapi.yaml (as make test runs them)."""
    port = port or free_port()
    log = open(home / "server.log", "ab")  # noqa: SIM115 - the process writes it until it ends
    return subprocess.Popen([str(KEEPSTATE), "serve", "--listen", f"127.0.0.1:{port}", "--runtime", "fake",
                             "--pool-size", "0", "--warm", "base", "--reap-on-exit", "--db", db],
                            env={**os.environ, "KEEPSTATE_HOME": str(home), "KEEPSTATE_VALIDATE_RESPONSES": "1"},
                            stdout=log, stderr=log,
                            start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def call(url: str, method: str = "GET", key: str = "", body: Any = None) -> tuple[int, dict[str, str], Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"X-API-KEY": key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
            return r.status, dict(r.headers), json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"null")


def start_fails(home: Path, db: str) -> tuple[int, str]:
    """Run a server that must not start: its exit code and what it said."""
    proc = serve(home, db)
    try:
        code = proc.wait(timeout=120)
    finally:
        stop(proc)
    return code, (home / "server.log").read_text()


@pytest.fixture
def pg() -> Iterator[PostgresServer]:
    from keepstate.testing.databases import require_postgres

    require_postgres()
    with PostgresServer() as server:
        yield server


def test_a_bad_url_ends_the_start_with_one_line(tmp_path: Path) -> None:
    code, said = start_fails(tmp_path, "mysql://root:hunter2@db/keepstate")
    assert code == 2, said
    assert "unknown scheme mysql://" in said and "accepted:" in said and "hunter2" not in said
    assert "Traceback" not in said


def test_an_unreachable_database_ends_the_start(tmp_path: Path) -> None:
    code, said = start_fails(tmp_path, f"postgresql://postgres@/keepstate?host={tmp_path}/no-server-here")
    assert code == 2, said
    assert "the database is unavailable" in said and "Traceback" not in said


def test_a_schema_newer_than_the_release_ends_the_start(tmp_path: Path, pg: PostgresServer) -> None:
    url = pg.createdb("newer")
    home = tmp_path / "first"
    home.mkdir()
    proc = serve(home, url)  # a first start upgrades the empty database to this release's head
    try:
        wait_health(_url_of(proc), proc, timeout=120)
    finally:
        stop(proc)
    subprocess.run(["runuser", "-u", "postgres", "--", "psql", "-h", str(pg.socket_dir), "-d", "newer", "-c",
                    "UPDATE alembic_version SET version_num = '9999'"], check=True, capture_output=True)
    code, said = start_fails(tmp_path, url)
    assert code == 2, said
    assert "revision 9999, newer than this release" in said and "Traceback" not in said


def _url_of(proc: subprocess.Popen[bytes]) -> str:
    args = [str(a) for a in proc.args]  # type: ignore[union-attr]
    return "http://" + args[args.index("--listen") + 1]


def test_a_database_that_goes_away_answers_503_and_loses_nothing(tmp_path: Path, pg: PostgresServer) -> None:
    url = pg.createdb("away")
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    proc = serve(tmp_path, url, port)
    try:
        wait_health(api, proc, timeout=120)
        env = {**os.environ, "KEEPSTATE_HOME": str(tmp_path), "KEEPSTATE_DB": url}
        key = subprocess.check_output([str(KEEPSTATE), "keys", "create", "t"], env=env,
                                      stderr=subprocess.DEVNULL).decode().strip()
        status, _, first = call(f"{api}/sandboxes", "POST", key, {"templateID": "base", "timeout": 600})
        assert status == 201, first

        pg.shutdown()
        # The key is known to the server (its cache): a create needs the database, and says it is away.
        status, headers, body = call(f"{api}/sandboxes", "POST", key, {"templateID": "base", "timeout": 600})
        assert status == 503, body
        assert headers.get("Retry-After") == "2" and headers.get("Should-Retry") == "true"
        assert body["code"] == 503 and "the database is unavailable" in body["message"]
        # A key the server has not seen needs the database too: 503, not 401 (it may be a good key).
        status, headers, body = call(f"{api}/sandboxes", key="e2b_" + "0" * 40)
        assert status == 503 and headers.get("Retry-After") == "2", body
        # The running sandbox is served from the server's own records meanwhile.
        status, _, info = call(f"{api}/sandboxes/{first['sandboxID']}", key=key)
        assert status == 200 and info["state"] == "running", info

        pg.restart()
        status, _, second = call(f"{api}/sandboxes", "POST", key, {"templateID": "base", "timeout": 600})
        assert status == 201, second
        status, _, listed = call(f"{api}/v2/sandboxes", key=key)
        assert status == 200
        assert {first["sandboxID"], second["sandboxID"]} <= {s["sandboxID"] for s in listed}
    finally:
        stop(proc)
    log = (tmp_path / "server.log").read_text()
    assert "internal error" not in log and "Traceback" not in log, log[-3000:]
