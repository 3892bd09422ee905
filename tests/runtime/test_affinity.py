"""runtime/affinity.py: a start gets the CPU fewest starts run on; unpin gives every thread of a process its
CPUs back, threads made while it runs included."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from keepstate.runtime import affinity


def test_each_start_gets_the_cpu_fewest_starts_run_on() -> None:
    cpus = affinity.StartCPUs([0, 1, 2])
    with cpus.one() as a, cpus.one() as b, cpus.one() as c:
        assert sorted([a, b, c]) == [0, 1, 2]  # type: ignore[type-var]
        with cpus.one() as d:
            assert d == 0  # all equally busy: the lowest
    with cpus.one() as e:
        assert e == 0  # every start ended: free again
    with cpus.one() as f, cpus.one() as g:
        assert (f, g) == (0, 1)


def test_concurrent_starts_spread_over_the_cpus() -> None:
    cpus = affinity.StartCPUs([0, 1])
    seen: list[int | None] = []
    inside = threading.Barrier(4)

    def start() -> None:
        with cpus.one() as cpu:
            seen.append(cpu)
            inside.wait(timeout=10)  # all four hold theirs at once

    workers = [threading.Thread(target=start) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=10)
    assert sorted(seen) == [0, 0, 1, 1]  # type: ignore[type-var]


def test_one_cpu_is_not_pinned() -> None:
    with affinity.StartCPUs([3]).one() as cpu:
        assert cpu is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin one")
def test_unpin_gives_every_thread_its_cpus_back() -> None:
    everywhere = frozenset(os.sched_getaffinity(0))
    one = min(everywhere)
    # A pinned process whose threads keep making threads, as a restored sentry may while it is unpinned.
    code = ("import threading, time, sys\n"
            "def spawn(n):\n"
            "    if n: threading.Thread(target=spawn, args=(n - 1,)).start()\n"
            "    time.sleep(30)\n"
            "for _ in range(4): threading.Thread(target=spawn, args=(20,)).start()\n"
            "print('up', flush=True); time.sleep(30)\n")
    proc = subprocess.Popen(["taskset", "-c", str(one), sys.executable, "-c", code], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        before = affinity.threads([proc.pid])
        assert before and all(os.sched_getaffinity(t) == {one} for t in before)
        changed = affinity.unpin(lambda: affinity.threads([proc.pid]), everywhere)
        now = affinity.threads([proc.pid])
        assert changed >= len(before)
        assert {t: os.sched_getaffinity(t) for t in now} == {t: everywhere for t in now}
    finally:
        proc.kill()
        proc.wait()


def test_threads_of_a_gone_process_are_none() -> None:
    done = subprocess.Popen(["true"])
    done.wait()
    assert affinity.threads([done.pid]) == set()
