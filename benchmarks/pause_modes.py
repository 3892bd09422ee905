"""Filesystem-only pause beside the full pause of the same sandbox, and what the disk costs a full pause.

    python benchmarks/pause_modes.py [--mib 64] [--repeat 3]

Starts its own KeepState server with no standbys (--standby-seconds 0: every resume comes from the store). A
`base` sandbox gets --mib MiB of changed files (random, incompressible, in 1 MiB files) and a process; then, in
the same run, with the stock e2b SDK:
  * full pause (memory and files) + resume: pause s, resume s, bytes the checkpoint added to the store;
  * filesystem-only pause (`mode="filesystem"`) + resume (a cold boot with the files): the same figures;
and, for what the disk-backed writable layer costs, the full pause and resume of the same sandbox on a server
whose sandboxes keep their writable layer in memory (--disk-mb 0, as before the disk).
Goal (issue 3): pause + resume of 256 MiB under 1 s, kept with the disk.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import row, server  # noqa: E402

MiB = 1 << 20


def one(srv, mib: int, files_only: bool) -> tuple[float, float, int]:
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=600)
    try:
        sbx.commands.run(f"mkdir -p /home/user/data && for i in $(seq {mib}); do "
                         f"head -c 1048576 /dev/urandom > /home/user/data/f$i; done", timeout=300)
        sbx.commands.run("sleep 600", background=True)
        t = time.perf_counter()
        sbx.pause(mode="filesystem") if files_only else sbx.pause()
        pause_s = time.perf_counter() - t
        stored = srv.added_bytes(sbx.sandbox_id)
        t = time.perf_counter()
        again = Sandbox.connect(sbx.sandbox_id)
        resume_s = time.perf_counter() - t
        n = again.commands.run("ls /home/user/data | wc -l").stdout.strip()
        assert int(n) == mib, n
        return pause_s, resume_s, stored
    finally:
        Sandbox.kill(sbx.sandbox_id)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with server(pool=2, extra=("--standby-seconds", "0")) as srv:
        srv.sdk_env()
        full = [one(srv, args.mib, False) for _ in range(args.repeat)]
        files = [one(srv, args.mib, True) for _ in range(args.repeat)]
    with server(pool=2, extra=("--standby-seconds", "0", "--disk-mb", "0")) as srv:
        srv.sdk_env()
        in_memory = [one(srv, args.mib, False) for _ in range(args.repeat)]

    def med(samples: list[tuple[float, float, int]], i: int) -> float:
        return statistics.median(s[i] for s in samples)

    print(f"A base sandbox with {args.mib} MiB of changed files, median of {args.repeat}, resumes from the store")
    print(row("filesystem-only pause", med(files, 0) * 1000, med(full, 0) * 1000, peer_name="full pause"))
    print(row("resume (cold boot + files)", med(files, 1) * 1000, med(full, 1) * 1000, peer_name="full resume"))
    print(row("pause + resume", (med(files, 0) + med(files, 1)) * 1000, (med(full, 0) + med(full, 1)) * 1000,
              peer_name="full pause + resume"))
    print(row("stored bytes", med(files, 2) / MiB, med(full, 2) / MiB, unit="MiB", peer_name="full pause"))
    print(f"  (the files themselves: {args.mib} MiB)")
    print("What the disk-backed writable layer costs a full pause (peer: the layer in memory, --disk-mb 0)")
    print(row("full pause", med(full, 0) * 1000, med(in_memory, 0) * 1000, peer_name="memory layer"))
    print(row("full resume", med(full, 1) * 1000, med(in_memory, 1) * 1000, peer_name="memory layer"))
    print(row("stored bytes", med(full, 2) / MiB, med(in_memory, 2) / MiB, unit="MiB", peer_name="memory layer"))


if __name__ == "__main__":
    main()
