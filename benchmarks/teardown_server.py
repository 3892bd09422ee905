"""Killing many idle sandboxes through the API: how fast the kills answer, and how long until every teardown is
finished and nothing is left on the host (docs/design/teardown.md).

    python benchmarks/teardown_server.py [--count 100] [--restart]

Starts its own server (own data dir, no warm pool, --reap-on-exit), creates --count sandboxes, kills them all at
once, and waits until /health reports no pending teardown and keepstate.testing.leftovers(home) is empty. With
--restart the server is SIGKILLed right after the kills answered and started again on the same data dir: the new
one must finish the teardowns.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import KEEPSTATE, TEMPLATE_CACHE, Server, free_port, wait_up  # noqa: E402

from keepstate.testing import leftovers  # noqa: E402


def start(home: Path, port: int, log_name: str) -> Server:
    env = {**os.environ, "KEEPSTATE_HOME": str(home), "KEEPSTATE_TEMPLATE_CACHE": TEMPLATE_CACHE}
    log = open(home / log_name, "wb")
    proc = subprocess.Popen([str(KEEPSTATE), "serve", "--listen", f"127.0.0.1:{port}", "--pool-size", "0",
                             "--warm", "", "--reap-on-exit", "--log-level", "warning"],
                            env=env, stdout=log, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_up(url, proc, home / log_name, every=0.1)
    return Server(url, "", home, proc)


def until_torn_down(srv: Server, t0: float, timeout: float = 600) -> float:
    while time.monotonic() - t0 < timeout:
        if int(srv.health().get("teardowns", 0)) == 0 and not leftovers(srv.home):  # type: ignore[call-overload]
            return time.monotonic() - t0
        time.sleep(0.2)
    raise TimeoutError(f"teardowns not finished: {srv.health()} {leftovers(srv.home)[:5]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--restart", action="store_true")
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="keepstate-bench-td-"))
    port = free_port()
    srv = start(home, port, "server.log")
    env = {**os.environ, "KEEPSTATE_HOME": str(home)}
    srv.key = subprocess.check_output([str(KEEPSTATE), "keys", "create", "bench"], env=env,
                                      stderr=subprocess.DEVNULL).decode().strip()
    try:
        t = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            ids = list(pool.map(lambda _: srv.api("POST", "/sandboxes", {"templateID": "base", "timeout": 3600})
                                ["sandboxID"], range(a.count)))  # type: ignore[index]
        print(f"created {a.count} in {time.monotonic() - t:.0f} s; "
              f"memory used {int(open('/proc/meminfo').read().split()[4]) >> 10} MiB free")
        time.sleep(5)  # idle
        answered: list[float] = []

        def kill(sid: str) -> None:
            t = time.monotonic()
            srv.api("DELETE", f"/sandboxes/{sid}")
            answered.append(time.monotonic() - t)

        t0 = time.monotonic()
        with ThreadPoolExecutor(50) as pool:
            list(pool.map(kill, ids))
        all_answered = time.monotonic() - t0
        answered.sort()
        print(f"{a.count} kills answered in {all_answered:.2f} s (each: p50 {answered[len(answered) // 2]:.3f} s, "
              f"max {answered[-1]:.3f} s)")
        if a.restart:
            os.killpg(srv.proc.pid, signal.SIGKILL)
            srv.proc.wait()
            print(f"server SIGKILLed with {len(leftovers(home))} leftovers; starting it again")
            srv = start(home, port, "server2.log")
        print(f"all torn down, nothing left, {until_torn_down(srv, t0):.1f} s after the kills began")
    except BaseException:
        for log in sorted(home.glob("server*.log")):
            print(f"--- {log.name}:\n" + log.read_text(errors="replace")[-3000:])
        raise
    finally:
        srv.proc.terminate()
        srv.proc.wait(timeout=300)
        left = leftovers(home)
        print(f"after the server stopped: {len(left)} leftovers")
        if not left:
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
