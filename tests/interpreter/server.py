"""A KeepState server for the interpreter tests, shared by every pytest-xdist worker of a run.

scripts/test.sh starts one server for the whole test run and names it in KEEPSTATE_TEST_API and
KEEPSTATE_TEST_KEY. Without those, the first worker to arrive starts one (its own data directory,
the shared template cache, a warm pool of code-interpreter sandboxes) and the last worker to
leave stops it; SIGTERM makes the server kill its sandboxes (--reap-on-exit).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KEEPSTATE = REPO / ".venv" / "bin" / "keepstate"
TEMPLATE = "code-interpreter-v1"
START_TIMEOUT = 300.0
# Servers this process started, kept so that they are waited for (and not garbage-collected running).
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


@dataclass(frozen=True)
class Server:
    url: str
    key: str


def template_cache() -> str:
    return os.environ.get("KEEPSTATE_TEMPLATE_CACHE", "/var/lib/keepstate/templates")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"keepstate serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not become healthy in {START_TIMEOUT:.0f} s; see {log}")


def start(home: Path, pool_size: int) -> tuple[Server, int]:
    """`keepstate serve` in its own process group; returns the server and its pid."""
    env = {**os.environ, "KEEPSTATE_HOME": str(home), "KEEPSTATE_TEMPLATE_CACHE": template_cache()}
    port = free_port()
    log = home / "server.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [str(KEEPSTATE), "serve", "--listen", f"127.0.0.1:{port}", "--pool-size", str(pool_size),
             "--warm", TEMPLATE, "--reap-on-exit"],
            env=env, stdout=out, stderr=out, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        key = subprocess.check_output([str(KEEPSTATE), "keys", "create", "interpreter-tests"], env=env,
                                      stderr=subprocess.DEVNULL, timeout=60).decode().strip()
    except BaseException:
        proc.terminate()
        proc.wait(timeout=60)
        raise
    _CHILDREN[proc.pid] = proc
    return Server(url=url, key=key), proc.pid


def stop(pid: int) -> None:
    """SIGTERM the server and wait until it has reaped its sandboxes and exited."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    child = _CHILDREN.pop(pid, None)
    if child is not None:
        child.wait(timeout=90)
        return
    # Started by another xdist worker: not our child, so poll until it is gone.
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)


@contextmanager
def shared(state_dir: Path, pool_size: int = 2) -> Iterator[Server]:
    """The run's server: the one named in the environment, or one shared through `state_dir`."""
    api, key = os.environ.get("KEEPSTATE_TEST_API"), os.environ.get("KEEPSTATE_TEST_KEY")
    if api and key:
        yield Server(url=api, key=key)
        return
    state_dir.mkdir(parents=True, exist_ok=True)
    state = state_dir / "server.json"
    with open(state_dir / "server.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if state.exists():
            info = json.loads(state.read_text())
        else:
            home = state_dir / "home"
            home.mkdir(exist_ok=True)
            srv, pid = start(home, pool_size)
            info = {"url": srv.url, "key": srv.key, "pid": pid, "users": 0}
        info["users"] += 1
        state.write_text(json.dumps(info))
    try:
        yield Server(url=info["url"], key=info["key"])
    finally:
        with open(state_dir / "server.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            info = json.loads(state.read_text())
            info["users"] -= 1
            if info["users"] == 0:
                stop(info["pid"])
                state.unlink()
            else:
                state.write_text(json.dumps(info))
