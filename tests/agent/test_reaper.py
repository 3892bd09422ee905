"""The child reaper, on both of its paths: pidfd (Linux hosts) and waiting threads, reused (gVisor)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading

import pytest

from keepstate.agent.reaper import ChildReaper


@pytest.mark.parametrize("use_pidfd", [True, False])
async def test_reaper_reports_exit_status(use_pidfd: bool) -> None:
    if use_pidfd and not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfd_open here")
    reaper = ChildReaper()
    reaper._pidfd_ok = use_pidfd  # noqa: SLF001 - force the path under test
    loop = asyncio.get_running_loop()
    reaper.install(loop)
    results: dict[int, int] = {}
    done = asyncio.Event()
    procs = [subprocess.Popen(["/bin/sh", "-c", f"exit {code}"]) for code in (0, 3, 7)]
    for proc in procs:
        def on_exit(status: int, proc: subprocess.Popen[bytes] = proc) -> None:
            proc.returncode = os.waitstatus_to_exitcode(status)
            results[proc.pid] = os.waitstatus_to_exitcode(status)
            if len(results) == len(procs):
                done.set()
        reaper.watch(proc.pid, on_exit)
    await asyncio.wait_for(done.wait(), 20)
    assert [results[p.pid] for p in procs] == [0, 3, 7]
    assert reaper.pending == 0
    for proc in procs:  # reaped exactly once, by the reaper
        with pytest.raises(ChildProcessError):
            os.waitpid(proc.pid, os.WNOHANG)


async def test_waiting_threads_are_reused() -> None:
    """One after another, children share one waiting thread; at once, each has its own."""
    reaper = ChildReaper()
    reaper._pidfd_ok = False  # noqa: SLF001 - the gVisor path
    loop = asyncio.get_running_loop()
    reaper.install(loop)

    async def run(codes: list[int]) -> list[int]:
        got: dict[int, int] = {}
        done = asyncio.Event()
        procs = [subprocess.Popen(["/bin/sh", "-c", f"sleep 0.2; exit {c}"]) for c in codes]
        for proc in procs:
            def on_exit(status: int, proc: subprocess.Popen[bytes] = proc) -> None:
                proc.returncode = got[proc.pid] = os.waitstatus_to_exitcode(status)
                if len(got) == len(procs):
                    done.set()
            reaper.watch(proc.pid, on_exit)
        await asyncio.wait_for(done.wait(), 20)
        return [got[p.pid] for p in procs]

    def waiters() -> int:
        return sum(t.name == "waitpid" for t in threading.enumerate())

    before = waiters()
    for code in range(4):
        assert await run([code]) == [code]
        await asyncio.sleep(0.05)  # the waiter is back in the pool
    assert waiters() - before == 1
    assert await run([1, 2, 3]) == [1, 2, 3]
    assert waiters() - before == 3
    assert reaper.pending == 0
