"""Runs the agent as a real subprocess plus a 40-line control-plane stub, so the STOCK e2b SDK can drive it.

Independent of `keepstate` internals on purpose: the same tests must run from a venv with another e2b version
(the agent is launched with $KEEPSTATE_AGENT_PYTHON, default the current interpreter) and, later, against the
real server and gVisor sandboxes.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
AGENT_PORT = 49983  # E2B's envd port, spelled out: no keepstate imports here (= keepstate.ports.AGENT_PORT)
START_TIMEOUT_S = 20.0

# Real-sandbox mode: scripts/test.sh names one shared KeepState server; the fixtures then create gVisor sandboxes
# through it with the stock SDK instead of running the agent on this host.
REMOTE_API = os.environ.get("KEEPSTATE_TEST_API") or ""
REMOTE_KEY = os.environ.get("KEEPSTATE_TEST_KEY") or ""
REMOTE = bool(REMOTE_API and REMOTE_KEY)
HOST_ONLY_REASON = "host mode only: pokes the agent process or calls /init, which the router keeps private"


def eventually(check: Callable[[], bool], within_s: float = 10.0, every_s: float = 0.05) -> bool:
    """Poll `check` until it holds or `within_s` passes: for effects that land asynchronously."""
    deadline = time.monotonic() + within_s
    while True:
        if check():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(every_s)


class AgentProcess:
    """`python -m keepstate.agent` on 127.0.0.1, a free port, with a template file of our own."""

    def __init__(self, workdir: Path, template: dict | None = None, python: str | None = None) -> None:
        self.workdir = workdir
        self.template_path = workdir / "template.json"
        self.template_path.write_text(json.dumps(template or {"user": "user", "workdir": "/home/user"}))
        self.log_path = workdir / "agent.log"
        self.service_log_dir = workdir / "service-logs"
        self.python = python or os.environ.get("KEEPSTATE_AGENT_PYTHON") or sys.executable
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.token: str | None = None

    def start(self) -> AgentProcess:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.pop("E2B_SANDBOX_URL", None)
        # Each host agent relays sudo on its own socket, never on the sandbox path /run/keepstate/sudo.sock; in a
        # directory other users can reach (pytest's tmp dirs are private to root).
        self.sudo_dir = tempfile.mkdtemp(prefix="ks-sudo-")
        os.chmod(self.sudo_dir, 0o755)
        env["KEEPSTATE_SUDO_SOCKET"] = os.path.join(self.sudo_dir, "sudo.sock")
        env["KEEPSTATE_SERVICE_LOG_DIR"] = str(self.service_log_dir)  # not the host's /var/log
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [self.python, "-m", "keepstate.agent", "--host", "127.0.0.1", "--port", "0",
             "--template", str(self.template_path), "--log-level", "info"],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(self.workdir),
        )
        deadline = started + START_TIMEOUT_S
        while time.monotonic() < deadline:
            match = re.search(rb"running on http://127\.0\.0\.1:(\d+)", self.log_path.read_bytes())
            if match:
                self.url = f"http://127.0.0.1:{int(match.group(1))}"
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited: {self.log_path.read_text()}")
            time.sleep(0.02)
        else:
            raise RuntimeError(f"agent did not start: {self.log_path.read_text()}")
        self.wait_healthy(deadline)
        self.startup_s = time.monotonic() - started
        return self

    def wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:  # noqa: S310 - loopback
                    if r.status == 204:
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("agent /health never answered")

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url + path, data=body, method=method, headers=headers or {})  # noqa: S310
        try:
            with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - loopback
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def init(self, token: str | None, env_vars: dict[str, str] | None = None) -> None:
        """What the host does when it hands out a sandbox: set a (new) token, authenticated by the old one."""
        body = json.dumps({"accessToken": token or "", "envVars": env_vars or {}, "timestamp": time.time()})
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["X-Access-Token"] = self.token
        status, text = self.request("POST", "/init", body.encode(), headers)
        if status != 204:
            raise RuntimeError(f"/init failed: {status} {text!r}")
        self.token = token or None

    def version(self) -> str:
        status, body = self.request("GET", "/version", headers={"X-Access-Token": self.token or ""})
        assert status == 200, body
        return json.loads(body)["version"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.sudo_dir, ignore_errors=True)


class ControlPlaneStub:
    """Just enough of the E2B API for `Sandbox.create()` / `kill()`: every sandbox is the one agent."""

    def __init__(self, agent: AgentProcess) -> None:
        self.agent = agent
        self.envd_version = agent.version()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _reply(self, status: int, body: object | None = None) -> None:
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                request = json.loads(self.rfile.read(length) or b"{}")
                if self.path in ("/sandboxes", "/v2/sandboxes"):
                    token = secrets.token_hex(16)
                    stub.agent.init(token, request.get("envVars") or {})
                    self._reply(201, {
                        "templateID": request.get("templateID", "base"), "sandboxID": "agent" + secrets.token_hex(6),
                        "clientID": "6532622b", "envdVersion": stub.envd_version, "envdAccessToken": token,
                        "alias": "base", "domain": None,
                    })
                elif self.path.endswith("/timeout"):
                    self._reply(204)
                else:
                    self._reply(404, {"code": 404, "message": "not found"})

            def do_DELETE(self) -> None:  # noqa: N802
                self._reply(204)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Wire:
    """Raw HTTP to one agent, directly (host mode) or through the server's data-plane router (real sandboxes)."""

    def __init__(self, url: str, token: str, routing: dict[str, str]) -> None:
        self.url = url
        self.token = token
        self.routing = routing  # E2b-Sandbox-Id/-Port: which sandbox the router sends the request to

    def client(self, authed: bool = False, timeout: float = 20.0):  # type: ignore[no-untyped-def]
        import httpx

        headers = dict(self.routing)
        if authed:
            headers["X-Access-Token"] = self.token
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)


def wire_of(sandbox: object) -> Wire:
    """Raw HTTP to the agent of an SDK sandbox, in either mode (the agent ignores the routing headers)."""
    return Wire(url=sandbox.envd_api_url, token=sandbox._envd_access_token or "",  # type: ignore[attr-defined]  # noqa: SLF001
                routing={"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": str(AGENT_PORT)})  # type: ignore[attr-defined]
