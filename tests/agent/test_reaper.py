"""The child reaper, on both of its paths: pidfd (Linux hosts) and one waiting thread per child (gVisor)."""

from __future__ import annotations

import asyncio
import os
import subprocess

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
