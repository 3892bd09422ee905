"""Teardown speed: N idle gVisor sandboxes destroyed at once on 16 threads, the old way (`runsc kill`, polling
`runsc state`, `runsc delete --force`) beside the new (SIGKILL through the cgroups, wait until reaped,
`runsc delete --force`); docs/design/teardown.md.

    python benchmarks/teardown.py [--count 20] [--threads 16] [--way new|old|both]

Uses the runtime directly (no server), its own data dir and slots 4000 and up; checks that nothing is left.
"""

from __future__ import annotations

import argparse
import os
import resource
import secrets
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("KEEPSTATE_TEMPLATE_CACHE", "/var/lib/keepstate/templates")

from keepstate.runtime import network  # noqa: E402
from keepstate.runtime.base import Handle, Limits, SandboxSpec, TemplateRoot  # noqa: E402
from keepstate.runtime.gvisor import GVisorRuntime  # noqa: E402
from keepstate.template import builder  # noqa: E402


def old_destroy(rt: GVisorRuntime, handle: Handle) -> None:
    """The destroy before docs/design/teardown.md."""
    rt._runsc("kill", handle.name, "KILL", timeout=20)
    deadline = time.monotonic() + 5
    while rt.state(handle.name) == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    rt._runsc("delete", "--force", handle.name, timeout=30)
    if handle.slot >= 0:
        network.destroy(network.link_for(handle.slot))
    shutil.rmtree(rt._dir(handle.name), ignore_errors=True)


def start(rt: GVisorRuntime, root: TemplateRoot, count: int, home: Path) -> list[Handle]:
    handles = []
    for _ in range(count):
        slot = next(n for n in range(4000, 4500) if network.claim_slot(n))
        name = "ks-bench-" + secrets.token_hex(4)
        network.record_slot_owner(slot, str(home), name)
        handles.append(rt.create(SandboxSpec(name, root, Limits(1, 256)), slot))
    time.sleep(3)  # let their agents start: idle sandboxes, not booting ones
    return handles


def measure(way: str, count: int, threads: int) -> None:
    built = builder.latest("base")
    assert built is not None, "build the base template first"
    home = Path(tempfile.mkdtemp(prefix="keepstate-bench-td-"))
    rt = GVisorRuntime(home / "sandboxes")
    rt.prepare()
    handles = start(rt, TemplateRoot(built.name, built.digest, built.rootfs), count, home)
    destroy = (lambda h: old_destroy(rt, h)) if way == "old" else rt.destroy
    times: list[float] = []

    def one(h: Handle) -> None:
        t = time.monotonic()
        try:
            destroy(h)
        finally:
            times.append(time.monotonic() - t)
            network.release_slot(h.slot)

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, handles))
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    times.sort()
    left = rt.inventory(home)
    print(f"{way}: {count} destroyed at once on {threads} threads in {wall:.2f} s; per destroy "
          f"p50 {times[len(times) // 2]:.2f} s, max {times[-1]:.2f} s; child CPU {cpu:.1f} s; "
          f"left: {len(left)} {sorted({lo.kind for lo in left})}")
    for lo in left:  # never leave anything behind, whatever the old way did
        rt.destroy(Handle(lo.name, -1))
    shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--way", choices=["new", "old", "both"], default="both")
    a = ap.parse_args()
    for way in (["old", "new"] if a.way == "both" else [a.way]):
        measure(way, a.count, a.threads)


if __name__ == "__main__":
    main()
