"""Sandbox speed: create-to-first-command, command round trip, concurrent creates, beside `runsc do true`.

    python benchmarks/sandbox.py [--count 20] [--pool 20]

Starts its own KeepState server (free port, own data dir, the shared template cache) with a
warm pool of --pool pre-started `base` sandboxes, waits for the pool to fill, then measures
with the stock e2b SDK:
  * create-to-first-command: Sandbox.create() + commands.run("true"), --count times, p50/p95
  * commands.run("true") round trip p50 (and p95), back to back and after 0.5 s idle each
  * 10 concurrent creates (the pool refilled first): wall time and per-create p50
and, in the same run, the peer: `runsc do true` (a fresh gVisor sandbox running `true`).
Goals (issue 2): create p50 under 150 ms, command round trip under 15 ms.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, pct, row, server  # noqa: E402

SHIM = "mount --make-rprivate / && mount -t tmpfs none /proc/sys/net && exec \"$@\""


def runsc_do_true(n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(["unshare", "-m", "--", "sh", "-c", SHIM, "sh", "runsc", "--network=none",
                        "--root=/run/keepstate/bench-runsc", "do", "true"], check=True, capture_output=True)
        out.append((time.perf_counter() - t) * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--pool", type=int, default=20)
    ap.add_argument("--runs", type=int, default=50, help="command round trips to time")
    ap.add_argument("--idle-runs", type=int, default=20, help="round trips to time after 0.5 s idle each")
    args = ap.parse_args()

    peer = runsc_do_true(5)
    with server(pool=args.pool) as srv:
        srv.sdk_env()
        from e2b import Sandbox

        srv.wait_pool("base", args.pool)
        create_first: list[float] = []
        create_only: list[float] = []
        made = []
        for _ in range(args.count):
            t = time.perf_counter()
            sbx = Sandbox.create(timeout=300)
            create_only.append((time.perf_counter() - t) * 1000)
            sbx.commands.run("true")
            create_first.append((time.perf_counter() - t) * 1000)
            made.append(sbx)
        rt: list[float] = []
        for _ in range(args.runs):
            t = time.perf_counter()
            made[0].commands.run("true")
            rt.append((time.perf_counter() - t) * 1000)
        idle: list[float] = []
        for _ in range(args.idle_runs):  # an agent thinking between commands (agent/spare.py works then)
            time.sleep(0.5)
            t = time.perf_counter()
            made[0].commands.run("true")
            idle.append((time.perf_counter() - t) * 1000)
        for sbx in made:
            sbx.kill()

        srv.wait_pool("base", min(args.pool, 10))
        per: list[float] = []

        def one(_: int) -> None:
            t = time.perf_counter()
            s = Sandbox.create(timeout=120)
            s.commands.run("true")
            per.append((time.perf_counter() - t) * 1000)
            s.kill()

        t = time.perf_counter()
        with ThreadPoolExecutor(10) as ex:
            list(ex.map(one, range(10)))
        wall = (time.perf_counter() - t) * 1000

    p = median(peer)
    print(f"KeepState sandboxes ({args.count} creates, warm pool of {args.pool}) vs `runsc do true` (median of 5)")
    print(row("create-to-first-command p50", median(create_first), p, peer_name="runsc do true p50"))
    print(row("create-to-first-command p95", pct(create_first, 95), p, peer_name="runsc do true p50"))
    print(row("  of which Sandbox.create() p50", median(create_only), p, peer_name="runsc do true p50"))
    print(row('commands.run("true") round trip p50', median(rt), p, peer_name="runsc do true p50"))
    print(row('commands.run("true") round trip p95', pct(rt, 95), p, peer_name="runsc do true p50"))
    print(row('commands.run("true") after 0.5 s idle p50', median(idle), p, peer_name="runsc do true p50"))
    print(row('commands.run("true") after 0.5 s idle p95', pct(idle, 95), p, peer_name="runsc do true p50"))
    print(row("10 concurrent creates: wall time", wall, p, peer_name="runsc do true p50"))
    print(row("10 concurrent creates: per-create p50", median(per), p, peer_name="runsc do true p50"))
    print("goals: create p50 < 150 ms; command round trip < 15 ms")


if __name__ == "__main__":
    main()
