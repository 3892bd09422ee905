"""Every CLI failure has one shape: `error: MESSAGE` on stderr, or with --json the API's error object
{"code", "message"} on stdout (a server's passed through unchanged), and a documented exit code."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result

from keepstate.cli import common
from keepstate.cli.main import SUBCOMMANDS, cli
from keepstate.db.repos import History
from keepstate.db.setup import prepare
from keepstate.db.url import default_url
from keepstate.session import EventLog
from keepstate.store import LocalBackend, Repository


def ks(home: Path, *args: str) -> Result:
    env = {"KEEPSTATE_HOME": str(home), "KEEPSTATE_DB": None, "KEEPSTATE_STORE": None, "E2B_API_KEY": None,
           "E2B_API_URL": None}
    return CliRunner(env=env).invoke(cli, list(args), prog_name="keepstate", catch_exceptions=False)


def json_error(result: Result, exit_code: int, status: int) -> dict[str, Any]:
    assert result.exit_code == exit_code, (result.stdout, result.stderr)
    assert result.stderr == ""
    error = json.loads(result.stdout)
    assert isinstance(error, dict) and error["code"] == status and isinstance(error["message"], str)
    return error


def text_error(result: Result, exit_code: int) -> str:
    assert result.exit_code == exit_code, (result.stdout, result.stderr)
    assert result.stdout == "" and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    return result.stderr


def test_unknown_checkpoint(tmp_path: Path) -> None:
    Repository.open(LocalBackend(tmp_path / "store"))
    error = json_error(ks(tmp_path, "checkpoint", "verify", "01NOSUCHCHECKPOINT", "--json"), 3, 404)
    assert "01NOSUCHCHECKPOINT" in error["message"]
    assert "01NOSUCHCHECKPOINT" in text_error(ks(tmp_path, "checkpoint", "verify", "01NOSUCHCHECKPOINT"), 3)


def test_no_store(tmp_path: Path) -> None:
    assert "no checkpoint store" in json_error(ks(tmp_path, "store", "verify", "--json"), 3, 404)["message"]
    assert "--store" in json_error(ks(tmp_path, "store", "gc", "--json", "--store", "ftp://x/y"), 2, 400)["message"]


def test_unknown_session(tmp_path: Path) -> None:
    async def record() -> None:
        db = await prepare(default_url(tmp_path), tmp_path)
        try:
            await EventLog(History(db)).append("isess1", "sandbox.create", {"template_id": "base"})
        finally:
            await db.close()

    asyncio.run(record())
    assert "nobody" in json_error(ks(tmp_path, "events", "nobody", "--json"), 3, 404)["message"]
    assert "nobody" in text_error(ks(tmp_path, "events", "nobody"), 3)
    assert "--api-url" in json_error(ks(tmp_path, "events", "isess1", "--replay", "--json"), 2, 400)["message"]


def test_ledger(tmp_path: Path) -> None:
    assert "no gateway ledger" in json_error(ks(tmp_path, "ledger", "--json"), 3, 404)["message"]
    assert "no gateway ledger" in text_error(ks(tmp_path, "ledger", "reconcile"), 3)
    # A usage error is JSON too once --json is on the command line, wherever the error is.
    error = json_error(ks(tmp_path, "ledger", "--json", "--bogus"), 2, 400)
    assert "--bogus" in error["message"] and "keepstate ledger --help" in error["message"]
    assert "--bogus" in json_error(ks(tmp_path, "ledger", "reconcile", "--bogus", "--json"), 2, 400)["message"]
    plain = ks(tmp_path, "ledger", "--bogus")  # without --json, click's usage message
    assert plain.exit_code == 2 and "Usage: keepstate ledger" in plain.stderr and plain.stdout == ""


def test_unknown_key_and_template(tmp_path: Path) -> None:
    assert "key_nope" in text_error(ks(tmp_path, "keys", "revoke", "key_nope"), 3)
    assert "no-such-template" in text_error(ks(tmp_path, "template", "build", "no-such-template"), 3)


class _Server(BaseHTTPRequestHandler):
    """Answers every request with the status and body the test put in `answers` for "METHOD /path"."""

    answers: dict[str, tuple[int, bytes]] = {}

    def _answer(self) -> None:
        route = f"{self.command} {self.path.split('?')[0]}"
        status, body = self.answers.get(route, (404, b'{"code": 404, "message": "no route"}'))
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_server_errors_pass_through(tmp_path: Path, server: str) -> None:
    answer = {"code": 404, "message": "template 'nope' not found", "error_code": "template_not_found"}
    _Server.answers = {"POST /v2/sandboxes": (404, json.dumps(answer).encode()),
                       "DELETE /sandboxes/sbx1": (500, b"<html>proxy error</html>")}
    api = ("sandbox", "--api-url", server, "--api-key", "k")
    assert json_error(ks(tmp_path, *api, "create", "--template", "nope", "--json"), 3, 404) == answer
    assert "template 'nope' not found" in text_error(ks(tmp_path, *api, "create", "--template", "nope"), 3)
    assert json_error(ks(tmp_path, *api, "ls", "--json"), 3, 404)["message"] == "no route"
    assert "HTTP 500" in text_error(ks(tmp_path, *api, "kill", "sbx1"), 4)
    assert "KEY=VALUE" in json_error(ks(tmp_path, *api, "create", "--env", "x", "--json"), 2, 400)["message"]


def test_no_server_or_no_key(tmp_path: Path) -> None:
    error = json_error(ks(tmp_path, "sandbox", "--api-url", "http://127.0.0.1:1", "--api-key", "k", "ls", "--json"),
                       4, 503)
    assert "cannot reach" in error["message"]
    assert "no API key" in json_error(ks(tmp_path, "sandbox", "ls", "--json"), 4, 401)["message"]


def _commands() -> Iterator[tuple[str, click.Command]]:
    def walk(path: str, cmd: click.Command) -> Iterator[tuple[str, click.Command]]:
        yield path, cmd
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                yield from walk(f"{path} {name}", sub)

    for name in SUBCOMMANDS:
        command = cli.get_command(click.Context(cli), name)
        assert command is not None
        yield from walk(name, command)


def test_every_command_reports_errors_the_one_way() -> None:
    with_json = []
    for path, cmd in _commands():
        assert isinstance(cmd, common._Reporting), f"`keepstate {path}` is not a keepstate.cli.common Command/Group"
        for param in cmd.params:
            if "--json" in getattr(param, "opts", []):
                assert param.callback is not None and "json_option" in param.callback.__qualname__, \
                    f"`keepstate {path} --json` is not made by common.json_option"
                with_json.append(path)
    assert {"checkpoint ls", "events", "ledger", "sandbox ls", "store verify", "template ls"} <= set(with_json)


def test_exit_codes_are_documented() -> None:
    text = CliRunner().invoke(cli, ["--help"]).stdout
    assert "Errors and exit codes" in text and '{"code": HTTP_STATUS, "message": "..."}' in text
    for code in (common.EXIT_PROBLEMS, common.EXIT_USAGE, common.EXIT_NOT_FOUND, common.EXIT_FAILED):
        assert f"\n    {code}  " in text
