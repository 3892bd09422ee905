"""Shared by the benchmarks: a throw-away KeepState server, percentiles, and side-by-side printing.

Benchmarks send traffic only to loopback and to the sandboxes' own addresses.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from keepstate.testing.internet import in_root_netns

REPO = Path(__file__).resolve().parents[1]
KEEPSTATE = REPO / ".venv" / "bin" / "keepstate"
TEMPLATE_CACHE = "/var/lib/keepstate/templates"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class Server:
    url: str
    key: str
    home: Path
    proc: subprocess.Popen[bytes]

    def env(self) -> dict[str, str]:
        return {**os.environ, "KEEPSTATE_HOME": str(self.home), "KEEPSTATE_TEMPLATE_CACHE": TEMPLATE_CACHE}

    def health(self) -> dict[str, object]:
        with _OPENER.open(self.url + "/health", timeout=5) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def api(self, method: str, path: str, body: object | None = None) -> object:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"X-API-KEY": self.key, "Content-Type": "application/json"})
        with _OPENER.open(req, timeout=600) as r:
            raw = r.read()
        return json.loads(raw) if raw else None

    def added_bytes(self, sandbox_id: str) -> int:
        """What the sandbox's latest checkpoint added to the store (`keepstate checkpoint ls`)."""
        out = json.loads(subprocess.check_output([str(KEEPSTATE), "checkpoint", "ls", "--json"], env=self.env()))
        return int([c for c in out if c["session_id"] == sandbox_id][-1]["stats"]["added_bytes"])

    def sdk_env(self) -> None:
        os.environ.update(E2B_API_URL=self.url, E2B_SANDBOX_URL=self.url, E2B_API_KEY=self.key,
                          NO_PROXY="127.0.0.1,localhost")

    def wait_pool(self, template: str, size: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pools = self.health().get("pools", {})
            if isinstance(pools, dict) and int(pools.get(template, 0)) >= size:
                return
            time.sleep(0.5)
        raise TimeoutError(f"the {template} pool did not reach {size}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


KEEP_LOG = os.environ.get("KEEPSTATE_BENCH_SERVER_LOG")


def wait_up(url: str, proc: subprocess.Popen[bytes], log: Path, every: float, timeout: float = 600) -> None:
    """Until the server at `url` answers /health; RuntimeError naming its log if it exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with _OPENER.open(url + "/health", timeout=2):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start; see {log}") from None
            time.sleep(every)


@contextmanager
def server(pool: int = 2, warm: str = "base", extra: tuple[str, ...] = (), db: str | None = None) -> Iterator[Server]:
    """A server of its own data directory; on the database `db` (default: its embedded SQLite)."""
    home = Path(tempfile.mkdtemp(prefix="keepstate-bench-"))
    port = free_port()
    env = {**os.environ, "KEEPSTATE_HOME": str(home), "KEEPSTATE_TEMPLATE_CACHE": TEMPLATE_CACHE}
    if db is not None:
        env["KEEPSTATE_DB"] = db
    if in_root_netns():  # no sandbox of a benchmark reaches a real address (network.py runs isolated instead)
        env["KEEPSTATE_EGRESS"] = "off"
    log = open(home / "server.log", "wb")
    proc = subprocess.Popen([str(KEEPSTATE), "serve", "--listen", f"127.0.0.1:{port}", "--pool-size", str(pool),
                             "--warm", warm, "--reap-on-exit", "--log-level", "info" if KEEP_LOG else "warning",
                             *extra],
                            env=env, stdout=log, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, proc, home / "server.log", every=0.2)
        key = subprocess.check_output([str(KEEPSTATE), "keys", "create", "bench"], env=env,
                                      stderr=subprocess.DEVNULL).decode().strip()
        yield Server(url, key, home, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        if KEEP_LOG:  # KEEPSTATE_BENCH_SERVER_LOG=path keeps the server's log (at level info) for a look
            with open(KEEP_LOG, "ab") as kept:
                kept.write((home / "server.log").read_bytes())
        shutil.rmtree(home, ignore_errors=True)


def pct(samples: list[float], p: float) -> float:
    s = sorted(samples)
    if not s:
        return float("nan")
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def row(name: str, ours: float, peer: float, unit: str = "ms", peer_name: str = "peer") -> str:
    ratio = ours / peer if peer else float("nan")
    return f"  {name:<44} {ours:>10.1f} {unit:<3} {peer_name:<22} {peer:>10.1f} {unit:<3} ratio {ratio:>6.2f}x"
