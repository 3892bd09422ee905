"""Round trips of `commands.run(...)` through a real KeepState server and a gVisor sandbox, and what the same
command costs inside the sandbox alone (so the difference is the agent's and the router's share).

    KEEPSTATE_TEST_API=http://127.0.0.1:PORT KEEPSTATE_TEST_KEY=... .venv/bin/python -m tests.agent.bench_sandbox

Not a test (no timing assertions in tests).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    api, key = os.environ["KEEPSTATE_TEST_API"], os.environ["KEEPSTATE_TEST_KEY"]
    os.environ.update({"E2B_API_URL": api, "E2B_SANDBOX_URL": api, "E2B_API_KEY": key})
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=300)
    try:
        for label, run in [
            ("commands.run('true')", lambda: sbx.commands.run("true")),
            ("commands.run('true', user='root')", lambda: sbx.commands.run("true", user="root")),
            ("files.read('/etc/hostname')", lambda: sbx.files.read("/etc/hostname")),
        ]:
            run()  # warm
            times = []
            for _ in range(args.runs):
                started = time.perf_counter()
                run()
                times.append((time.perf_counter() - started) * 1000)
            print(f"{label:40s} p50 {statistics.median(times):6.1f} ms  p90 {_pct(times, 0.9):6.1f} ms")
        sbx.commands.run("test -e /usr/local/bin/sudo || ln -s /opt/keepstate/lib/keepstate/agent/sudo_client.py "
                         "/usr/local/bin/sudo", user="root")
        inside = sbx.commands.run(
            "python3 -c \"import subprocess,time,statistics\n"
            "def t(a):\n"
            "  r=[]\n"
            "  for _ in range(15):\n"
            "    s=time.perf_counter(); subprocess.run(a); r.append((time.perf_counter()-s)*1000)\n"
            "  return statistics.median(r)\n"
            "print('inside: bash -l -c true %.1f ms, bash -c true %.1f ms, true %.1f ms, sudo true %.1f ms' % "
            "(t(['bash','-l','-c','true']), t(['bash','-c','true']), t(['true']), t(['sudo','-n','true'])))\"")
        print(inside.stdout.strip())
    finally:
        sbx.kill()


if __name__ == "__main__":
    main()
