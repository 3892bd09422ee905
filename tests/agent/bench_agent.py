"""Measures the agent on this host: time to first /health, and `commands.run("true")` round trips via the SDK.

    .venv/bin/python -m tests.agent.bench_agent [--starts 5] [--runs 50]

Not a test (no timing assertions in tests); numbers to compare with later runs inside gVisor.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.agent.harness import REPO_ROOT, AgentProcess, ControlPlaneStub


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_health(python: str) -> float:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    started = time.perf_counter()
    proc = subprocess.Popen([python, "-m", "keepstate.agent", "--host", "127.0.0.1", "--port", str(port),
                             "--template", "/nonexistent"], env=env, stdout=subprocess.DEVNULL)
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:  # noqa: S310
                    if r.status == 204:
                        return time.perf_counter() - started
            except OSError:
                time.sleep(0.002)
            if time.perf_counter() - started > 20:
                raise RuntimeError("agent did not start")
    finally:
        proc.terminate()
        proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    starts = [time_to_health(args.python) for _ in range(args.starts)]
    print(f"time to first /health: p50 {statistics.median(starts) * 1000:.0f} ms "
          f"(min {min(starts) * 1000:.0f}, max {max(starts) * 1000:.0f}, n={len(starts)})")

    with tempfile.TemporaryDirectory() as tmp:
        agent = AgentProcess(Path(tmp)).start()
        stub = ControlPlaneStub(agent)
        os.environ.update({"E2B_API_KEY": "bench", "E2B_API_URL": stub.url, "E2B_SANDBOX_URL": agent.url})
        try:
            from e2b import Sandbox

            sbx = Sandbox.create()
            first = time.perf_counter()
            sbx.commands.run("true")
            first_ms = (time.perf_counter() - first) * 1000
            samples = []
            for _ in range(args.runs):
                t = time.perf_counter()
                sbx.commands.run("true")
                samples.append(time.perf_counter() - t)
            samples.sort()
            print(f"commands.run('true'): first {first_ms:.0f} ms; p50 {statistics.median(samples) * 1000:.1f} ms, "
                  f"p90 {samples[int(len(samples) * 0.9)] * 1000:.1f} ms (n={len(samples)})")
            rss = Path(f"/proc/{agent.proc.pid}/status").read_text().split("VmRSS:")[1].split()[0]
            print(f"agent RSS after the runs: {int(rss) // 1024} MiB")
        finally:
            stub.stop()
            agent.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
