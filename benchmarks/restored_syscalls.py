"""The cost of one system call in a sandbox restored from a checkpoint, beside a fresh one, in the same run.

    python benchmarks/restored_syscalls.py [--calls 200000]

Starts its own KeepState server with no standbys (--standby-mb 0: a resume restores from the store). In a `base`
sandbox a fresh Python process makes --calls `fcntl(0, F_GETFD)` and prints the mean cost of one; measured three
times in: a new sandbox (restored from its template's boot image), a fork's child, the same sandbox paused and
resumed from the store (at once and 30 s later), and the fork's parent. Found on 2026-12-05 (docs/design/desktop.md,
x11vnc): ~0.7-1.2 us fresh, ~36-42 us in any instance restored from a checkpoint other than a boot image, for as
long as it runs. Open: why; until it is found, syscall-heavy work in a forked or resumed session runs that much
slower.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import row, server  # noqa: E402


def per_call_us(sbx, calls: int) -> float:
    code = (f"import fcntl, time; t = time.perf_counter(); n = {calls}\n"
            "for _ in range(n): fcntl.fcntl(0, fcntl.F_GETFD)\n"
            "print((time.perf_counter() - t) / n * 1e6)")
    sbx.files.write("/tmp/rate.py", code)
    return statistics.median(float(sbx.commands.run("python3 /tmp/rate.py", timeout=300).stdout) for _ in range(3))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200_000)
    args = ap.parse_args()
    from e2b import Sandbox

    with server(pool=0, extra=("--standby-mb", "0")) as srv:
        srv.sdk_env()
        sbx = Sandbox.create(timeout=600)
        made = [sbx]
        try:
            fresh = per_call_us(sbx, args.calls)
            child = sbx.fork(count=1)[0]
            assert isinstance(child, Sandbox), child
            made.append(child)
            forked = per_call_us(child, args.calls)
            parent = per_call_us(sbx, args.calls)
            sbx.pause()
            time.sleep(5)  # --standby-mb 0 releases the frozen instance within a moment: the resume restores
            resumed = Sandbox.connect(sbx.sandbox_id, timeout=600)
            from_store = per_call_us(resumed, args.calls)
            time.sleep(30)
            later = per_call_us(resumed, args.calls)
        finally:
            for s in made:
                try:
                    s.kill()
                except Exception:
                    pass
    print(f"one fcntl(F_GETFD), median of 3 runs of {args.calls}")
    print(row("in a fork's child", forked, fresh, unit="us", peer_name="a new sandbox"))
    print(row("in the fork's parent", parent, fresh, unit="us", peer_name="a new sandbox"))
    print(row("resumed from the store", from_store, fresh, unit="us", peer_name="a new sandbox"))
    print(row("resumed from the store, 30 s later", later, fresh, unit="us", peer_name="a new sandbox"))


if __name__ == "__main__":
    main()
