"""Reaping of the agent's own children.

The agent is not PID 1 (tini is), so orphaned grandchildren are not ours to reap; but every child we fork must be
waited for, or it stays a zombie. uvloop reserves SIGCHLD, so each child is watched through a pidfd (readable when
it exits). gVisor 20240729 has no pidfd_open (ENOSYS): there a small thread blocks in `waitpid(pid)` per child and
hands the status to the loop. (An earlier version polled every 20 ms, later every 250 ms: that was up to a quarter
of a second of latency on every command's end.) Those threads are kept and reused: starting one costs ~3 ms
under gVisor (tens under load), and `Thread.start` blocks the event loop until the thread runs. We only ever wait
for pids we registered, so library code that uses `subprocess.run` elsewhere keeps working.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Callable

ExitCallback = Callable[[int], None]  # receives the raw wait status


class ChildReaper:
    def __init__(self) -> None:
        self._children: dict[int, ExitCallback] = {}
        self._pidfds: dict[int, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pidfd_ok = hasattr(os, "pidfd_open")
        self._pids: queue.SimpleQueue[tuple[int, asyncio.AbstractEventLoop]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # waiter threads blocked on `_pids`, free to take a child

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def watch(self, pid: int, on_exit: ExitCallback) -> None:
        """Call `on_exit(status)` from the event loop once `pid` has exited."""
        loop = self._loop or asyncio.get_running_loop()
        self._loop = loop
        self._children[pid] = on_exit
        if self._pidfd_ok:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                self._pidfd_ok = False  # e.g. ENOSYS in gVisor
            else:
                self._pidfds[pid] = fd
                loop.add_reader(fd, self._reap_one, pid)
                return
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # that waiter's now: a second child at once gets a thread of its own
        if start:
            threading.Thread(target=self._waiter, args=(pid, loop), name="waitpid", daemon=True).start()
        else:
            self._pids.put((pid, loop))

    def _waiter(self, pid: int, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            self._wait_in_thread(pid, loop)
            with self._lock:
                self._idle += 1
            pid, loop = self._pids.get()

    def _wait_in_thread(self, pid: int, loop: asyncio.AbstractEventLoop) -> None:
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            status = 0  # reaped elsewhere; report a plain exit
        try:
            loop.call_soon_threadsafe(self._deliver, pid, status)
        except RuntimeError:
            pass  # the loop is closed: the agent is stopping

    def _deliver(self, pid: int, status: int) -> None:
        callback = self._children.pop(pid, None)
        if callback is not None:
            callback(status)

    def _reap_one(self, pid: int) -> None:
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            got, status = pid, 0  # reaped elsewhere; report a plain exit
        if got != pid:
            return
        fd = self._pidfds.pop(pid, None)
        if fd is not None and self._loop is not None:
            self._loop.remove_reader(fd)
            os.close(fd)
        self._deliver(pid, status)

    @property
    def pending(self) -> int:
        return len(self._children)


REAPER = ChildReaper()
