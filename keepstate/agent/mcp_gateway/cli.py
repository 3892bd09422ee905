"""`mcp-gateway`, the program E2B's SDK runs in a sandbox (docs/design/mcp-gateway.md, "Contract").

    mcp-gateway --config '{"time": {}}'     check, start the gateway as a daemon, exit 0 once it answers
    mcp-gateway pull time fetch             exit non-zero naming the servers that cannot run here
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from keepstate.ports import MCP_PORT

from .config import CATALOG, ConfigError, ServerSpec, missing, parse

PORT = MCP_PORT
TOKEN_FILE = "/etc/mcp-gateway/.token"
LOG_FILE = "/var/log/mcp-gateway/gateway.log"
PID_FILE = "/run/mcp-gateway.pid"
READY_TIMEOUT = 60.0


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mcp-gateway", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the servers, as E2B's `mcp` object (JSON)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=PORT)
    p.add_argument("--token-file", default=TOKEN_FILE)
    p.add_argument("--log-file", default=LOG_FILE)
    p.add_argument("--pid-file", default=PID_FILE, help="where the daemon's pid is written")
    p.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT)
    p.add_argument("--foreground", action="store_true", help="serve here (what the daemon runs)")
    return p.parse_args(argv)


def _save_token(path: str, token: str) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.chmod(target, 0o600)


def _answers(port: int) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _tail(path: str, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _start_daemon(args: argparse.Namespace, token: str) -> int:
    Path(args.log_file).parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "keepstate.agent.mcp_gateway", "--foreground", "--config", args.config,
            "--host", args.host, "--port", str(args.port), "--token-file", args.token_file,
            "--log-file", args.log_file]
    with open(args.log_file, "ab") as log, open(os.devnull, "rb") as null:
        child = subprocess.Popen(argv, stdin=null, stdout=log, stderr=log, start_new_session=True,
                                 env={**os.environ, "GATEWAY_ACCESS_TOKEN": token})
    Path(args.pid_file).parent.mkdir(parents=True, exist_ok=True)
    Path(args.pid_file).write_text(f"{child.pid}\n")
    deadline = time.monotonic() + args.ready_timeout
    while time.monotonic() < deadline:
        if _answers(args.port):
            print(f"mcp-gateway: serving on port {args.port} (log {args.log_file})")
            return 0
        if child.poll() is not None:
            print(f"mcp-gateway failed to start (exit {child.returncode}); its log:\n{_tail(args.log_file)}",
                  file=sys.stderr)
            return 1
        time.sleep(0.1)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    print(f"mcp-gateway did not answer within {args.ready_timeout:.0f} s; its log:\n{_tail(args.log_file)}",
          file=sys.stderr)
    return 1


def _pull(names: list[str]) -> int:
    unknown = [n for n in names if n not in CATALOG]
    if unknown:
        print(f"mcp-gateway pull: unknown server(s) {', '.join(unknown)}: this gateway has "
              f"{', '.join(sorted(CATALOG))}", file=sys.stderr)
        return 2
    absent = missing([ServerSpec(n, CATALOG[n][0]) for n in names])
    if absent:
        print(f"mcp-gateway pull: not installed here: {', '.join(absent)}", file=sys.stderr)
        return 1
    print(f"mcp-gateway pull: ready: {', '.join(names)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["pull"]:
        return _pull(argv[1:])
    args = _args(argv)
    try:
        specs = parse(json.loads(args.config))
    except (ConfigError, json.JSONDecodeError) as e:
        print(f"mcp-gateway: {e}", file=sys.stderr)
        return 2
    token = os.environ.get("GATEWAY_ACCESS_TOKEN") or secrets.token_hex(16)
    if not args.foreground:
        _save_token(args.token_file, token)
        return _start_daemon(args, token)
    import asyncio

    from .gateway import serve

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    try:
        asyncio.run(serve(specs, token, args.host, args.port, sys.stderr))
    except Exception as e:  # noqa: BLE001 - the reason goes to the log, which the launcher shows
        logging.getLogger("mcp-gateway").error("%s", e)
        return 1
    return 0
