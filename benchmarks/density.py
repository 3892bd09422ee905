"""Density: how many idle `base` sandboxes one host holds, and whether it stays responsive (issue 11).

    python benchmarks/density.py [--steps 50,150,300] [--batch 4] [--pool 2] [--server-arg ...]

Starts its own KeepState server (free port, own data dir, the shared template cache), then with the stock e2b SDK:
  * 1 sandbox first: create, idle CPU, memory, `commands.run("true")` p50/p95 (the baseline every step is beside);
  * then grows to each N of --steps, creating --batch at a time, and at each N reports create p50/p95 (of the
    sandboxes created in that step), memory per sandbox, total idle CPU of all sandbox processes (their cgroups'
    cpuacct over --idle-seconds, after --settle seconds of quiet) and of the server process, `commands.run("true")`
    p50/p95 over --runs sandboxes picked at random, and every 5xx seen;
  * at the end kills every sandbox, 16 kills at a time: the time until all kills are answered and until the host
    holds nothing of them (no container, cgroup, network slot or namespace, state directory).
The peer, measured in the same run: one bare `runsc --network=none do sleep` (no agent, no Python), idle.
Goals (issue 11): 300 idle sandboxes; their idle CPU under 50 % of one core; command p50 at 300 within 2x of 1;
create p95 under 2 s; zero 5xx; kill of all 300 under 60 s with nothing left behind.
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, pct, server  # noqa: E402

SHIM = "mount --make-rprivate / && mount -t tmpfs none /proc/sys/net && exec \"$@\""
CPUACCT = Path("/sys/fs/cgroup/cpuacct/keepstate")
MEMORY = Path("/sys/fs/cgroup/memory/keepstate")
TICK = os.sysconf("SC_CLK_TCK")


def pool_names(home: Path) -> set[str]:
    """The runtime names of the server's warm pool now (its database's POOLED rows): what a kill of every listed
    sandbox leaves running, by design."""
    db = sqlite3.connect(f"file:{home / 'keepstate.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        return {name for (name,) in db.execute("SELECT runtime_name FROM sandboxes WHERE state = 'pooled'")}
    finally:
        db.close()


def cgroups() -> set[str]:
    return {p.name for p in CPUACCT.iterdir() if p.is_dir()} if CPUACCT.exists() else set()


def cpu_ns(names: set[str]) -> int:
    total = 0
    for name in names:
        try:
            total += int((CPUACCT / name / "cpuacct.usage").read_text())
        except OSError:
            pass
    return total


def memory_bytes(names: set[str]) -> int:
    """Memory of these cgroups the host cannot reclaim (usage less inactive file pages, as `docker stats`)."""
    total = 0
    for name in names:
        try:
            used = int((MEMORY / name / "memory.usage_in_bytes").read_text())
            stat = dict(line.split() for line in (MEMORY / name / "memory.stat").read_text().splitlines())
            # gVisor's memory file is shmem, which v1 counts as cache: only inactive file pages are reclaimable.
            total += used - int(stat.get("total_inactive_file", stat.get("inactive_file", 0)))
        except (OSError, ValueError):
            pass
    return total


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime (threads included)


def peer_idle_cpu(seconds: float) -> float:
    """% of one core a bare gVisor sandbox uses while its only process sleeps."""
    proc = subprocess.Popen(["unshare", "-m", "--", "sh", "-c", SHIM, "sh", "runsc", "--network=none",
                             "--platform=systrap", "--root=/run/keepstate/bench-runsc", "do", "sleep",
                             str(int(seconds) + 30)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        time.sleep(5)

        def tree_cpu() -> float:
            out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid), "-g", str(proc.pid)],
                                 capture_output=True, text=True).stdout.split()
            pids = {int(p) for p in out} | {proc.pid}
            # every runsc process of this session (the sandbox's exe re-execs itself)
            total = 0.0
            for pid in pids:
                try:
                    total += proc_cpu_s(pid)
                except OSError:
                    pass
            return total

        a = tree_cpu()
        time.sleep(seconds)
        return (tree_cpu() - a) / seconds * 100
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


class Run:
    def __init__(self, srv: Any, server_pid: int, ours_before: set[str]) -> None:
        self.srv, self.server_pid, self.before = srv, server_pid, ours_before
        self.sandboxes: list[Any] = []
        self.errors_5xx: list[str] = []
        self.busy = 0
        self.lock = threading.Lock()

    def ours(self) -> set[str]:
        return cgroups() - self.before

    def create_one(self) -> float | None:
        from e2b import Sandbox

        for _ in range(20):
            t = time.perf_counter()
            try:
                sbx = Sandbox.create(timeout=3600)
            except Exception as exc:  # the SDK raises on every non-2xx
                text = str(exc)
                with self.lock:
                    if "busy" in text.lower() or "503" in text and "retry" in text.lower():
                        self.busy += 1  # the documented "busy, retry" answer: retried, not a failure
                    else:
                        self.errors_5xx.append(text[:200])
                        return None
                time.sleep(1)
                continue
            took = time.perf_counter() - t
            with self.lock:
                self.sandboxes.append(sbx)
            return took
        return None

    def grow(self, n: int, batch: int) -> list[float]:
        need = n - len(self.sandboxes)
        with ThreadPoolExecutor(batch) as ex:
            times = list(ex.map(lambda _: self.create_one(), range(need)))
        return [t for t in times if t is not None]

    def command_times(self, runs: int) -> list[float]:
        out = []
        picks = random.Random(len(self.sandboxes)).choices(self.sandboxes, k=runs)
        for sbx in picks:
            time.sleep(0.2)
            t = time.perf_counter()
            try:
                sbx.commands.run("true")
            except Exception as exc:
                self.errors_5xx.append(f"commands.run: {str(exc)[:200]}")
                continue
            out.append((time.perf_counter() - t) * 1000)
        return out

    def idle(self, settle: float, seconds: float) -> tuple[float, float]:
        """(% of one core: all sandbox processes, the server) over `seconds` of quiet."""
        time.sleep(settle)
        names = self.ours()
        c0, s0, t0 = cpu_ns(names), proc_cpu_s(self.server_pid), time.monotonic()
        time.sleep(seconds)
        dt = time.monotonic() - t0
        return ((cpu_ns(names) - c0) / 1e9 / dt * 100, (proc_cpu_s(self.server_pid) - s0) / dt * 100)


def report(label: str, n: int, creates: list[float], cpu: tuple[float, float], mem: float, cmd: list[float],
           base: dict[str, float] | None, frozen: int | None) -> dict[str, float]:
    fig = {"create_p50": median(creates) if creates else float("nan"),
           "create_p95": pct(creates, 95) if creates else float("nan"),
           "cpu": cpu[0], "cpu_each": cpu[0] / max(n, 1), "server": cpu[1], "mem": mem / 2**20,
           "cmd_p50": median(cmd) if cmd else float("nan"), "cmd_p95": pct(cmd, 95) if cmd else float("nan")}
    print(f"\nN = {n} ({label}){'' if frozen is None else f'; frozen now: {frozen}/{n}'}")

    def line(name: str, key: str, unit: str, fmt: str = "{:>9.2f}") -> None:
        ours = fig[key]
        if base is None:
            print(f"  {name:<40} {fmt.format(ours)} {unit}")
        else:
            b = base[key]
            ratio = ours / b if b else float("nan")
            print(f"  {name:<40} {fmt.format(ours)} {unit:<4} at N=1: {fmt.format(b)} {unit:<4} ratio {ratio:6.2f}x")

    line("create p50", "create_p50", "s")
    line("create p95", "create_p95", "s")
    line("idle CPU, all sandbox processes", "cpu", "%")
    line("idle CPU per sandbox", "cpu_each", "%", "{:>9.3f}")
    line("idle CPU, the server", "server", "%")
    line("memory per sandbox (cgroups, unreclaimable)", "mem", "MiB", "{:>9.1f}")
    line("commands.run(\"true\") p50", "cmd_p50", "ms", "{:>9.1f}")
    line("commands.run(\"true\") p95", "cmd_p95", "ms", "{:>9.1f}")
    return fig


def frozen_count(names: set[str]) -> int:
    n = 0
    for name in names:
        try:
            if Path(f"/sys/fs/cgroup/freezer/keepstate/{name}/freezer.state").read_text().strip() == "FROZEN":
                n += 1
        except OSError:
            pass
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default="50,150,300")
    ap.add_argument("--batch", type=int, default=4, help="creates at a time")
    ap.add_argument("--pool", type=int, default=2)
    ap.add_argument("--runs", type=int, default=40, help="commands to time at each N")
    ap.add_argument("--settle", type=float, default=15, help="quiet seconds before idle CPU is measured")
    ap.add_argument("--idle-seconds", type=float, default=20)
    ap.add_argument("--server-arg", action="append", default=[], help="an extra `keepstate serve` argument")
    args = ap.parse_args()
    steps = [int(s) for s in args.steps.split(",") if s]

    peer = peer_idle_cpu(args.idle_seconds)
    print(f"peer: a bare `runsc do sleep` (systrap, no network, no agent), idle: {peer:.2f} % of one core")
    extra = tuple(a for arg in args.server_arg for a in arg.split())
    before = cgroups()
    with server(pool=args.pool, extra=extra) as srv:
        srv.sdk_env()
        if args.pool:
            srv.wait_pool("base", args.pool)
        run = Run(srv, srv.proc.pid, before)
        pooled = set(run.ours())
        creates = run.grow(1, 1)
        cmd = run.command_times(args.runs)
        cpu = run.idle(args.settle, args.idle_seconds)
        names = run.ours()
        base = report("baseline", 1, creates, cpu, memory_bytes(names) / max(len(names), 1), cmd, None,
                      frozen_count(names))
        figs = {}
        for n in steps:
            t0 = time.monotonic()
            creates = run.grow(n, args.batch)
            grow_s = time.monotonic() - t0
            names = run.ours()
            cpu = run.idle(args.settle, args.idle_seconds)
            mem = memory_bytes(names) / max(len(names), 1)  # the pool's few included
            frozen = frozen_count(names)
            cmd = run.command_times(args.runs)
            figs[n] = report(f"grown in {grow_s:.0f} s, {args.batch} at a time", len(run.sandboxes), creates,
                             cpu, mem, cmd, base, frozen)
            load = os.getloadavg()
            print(f"  load average {load[0]:.1f} {load[1]:.1f}; per-sandbox idle CPU vs the bare runsc peer "
                  f"{peer:.2f} %: ratio {figs[n]['cpu_each'] / peer if peer else float('nan'):.3f}x")
        count = len(run.sandboxes)
        ours = run.ours() - pooled
        t0 = time.monotonic()
        def kill(sbx: Any) -> None:
            try:
                sbx.kill()
            except Exception as exc:  # a kill not answered within the SDK's timeout is a figure, not a crash
                run.errors_5xx.append(f"kill: {str(exc)[:200]}")

        with ThreadPoolExecutor(16) as ex:
            list(ex.map(kill, run.sandboxes))
        answered = time.monotonic() - t0
        left = ours & run.ours() - pool_names(srv.home)
        while left and time.monotonic() - t0 < 600:
            time.sleep(0.5)
            left = ours & run.ours() - pool_names(srv.home)  # the pool refilled meanwhile: those stay
        gone = time.monotonic() - t0
        leftovers = []
        try:
            from keepstate.testing import leftovers as find_leftovers  # type: ignore[attr-defined]

            kept = pooled | pool_names(srv.home)
            leftovers = [x for x in find_leftovers(srv.home) if not any(p in str(x) for p in kept)]
        except ImportError:
            pass
        print(f"\nkill of all {count}: answered in {answered:.1f} s; cgroups gone in {gone:.1f} s "
              f"({len(left)} still there); other leftovers: {leftovers or 'none'}")
        print(f"5xx seen: {len(run.errors_5xx)}; documented 'busy' answers retried: {run.busy}")
        for e in run.errors_5xx[:10]:
            print("   ", e)
        top = max(steps) if steps else 1
        f = figs.get(top, base)
        print(f"\ngoals at N={top}: idle CPU {f['cpu']:.1f} % [< 50 %]; command p50 {f['cmd_p50']:.0f} ms vs "
              f"{base['cmd_p50']:.0f} ms at 1 = {f['cmd_p50'] / base['cmd_p50']:.2f}x [< 2x]; create p95 "
              f"{f['create_p95']:.2f} s [< 2 s]; 5xx {len(run.errors_5xx)} [0]; kill-all {gone:.0f} s [< 60 s]")


if __name__ == "__main__":
    main()
