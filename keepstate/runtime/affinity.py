"""One CPU per restore, then every CPU again (docs/design/admission.md, "One CPU per restore").

A `runsc restore` is CPU-bound, and much of its time is the kernel's: faulting in and filling the sandbox's
memory file, and the TLB shootdowns its unmaps send to every CPU its threads have run on. Run on one CPU, those
shootdowns are local, and two restores on two CPUs do not interleave on both. Measured on the 2-vCPU host, 40
creates 4 at a time: 3.1-3.2 starts a second unpinned, 3.4-3.6 pinned (at 300 sandboxes the difference was within
the run-to-run noise). Once the sandbox runs, its threads get
back every CPU the server may use: a sandbox's CPU limit is its cgroup's, never its affinity.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager


class StartCPUs:
    """Hands each start the CPU the fewest starts are running on now (threads: starts run on worker threads)."""

    def __init__(self, cpus: Iterable[int] | None = None) -> None:
        allowed = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
        self.all = frozenset(allowed)
        self._busy = {cpu: 0 for cpu in allowed}
        self._lock = threading.Lock()

    @contextmanager
    def one(self) -> Iterator[int | None]:
        """A CPU to pin a start to, or None where there is only one (nothing to gain)."""
        if len(self._busy) < 2:
            yield None
            return
        with self._lock:
            cpu = min(self._busy, key=lambda c: (self._busy[c], c))
            self._busy[cpu] += 1
        try:
            yield cpu
        finally:
            with self._lock:
                self._busy[cpu] -= 1


def threads(pids: Iterable[int]) -> set[int]:
    """Every thread of these processes (gone ones are skipped)."""
    out: set[int] = set()
    for pid in pids:
        try:
            out.update(int(t) for t in os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return out


def unpin(list_threads: Callable[[], Iterable[int]], cpus: frozenset[int]) -> int:
    """Give `cpus` to every thread `list_threads()` names, again until a pass finds none left to change (a thread
    that a still-pinned one made meanwhile inherits its mask; a process that keeps making threads needs several
    passes, hence the bound of 50, not 5: with 5, the test's chains of threads outran it about one run in 13).
    Not closed: a clone still in flight when its parent is changed, and not listed yet by the next pass, keeps the
    old mask. How many threads were changed."""
    changed = 0
    for _ in range(50):
        left = 0
        for tid in list_threads():
            try:
                if os.sched_getaffinity(tid) != cpus:
                    os.sched_setaffinity(tid, cpus)
                    left += 1
            except OSError:  # gone, or not ours to change
                pass
        changed += left
        if not left:
            break
    return changed
