"""Reaping of the agent's own children.

The agent is not PID 1 (tini is), so orphaned grandchildren are not ours to reap; but every child we fork must be
waited for, or it stays a zombie. uvloop reserves SIGCHLD, so each child is watched through a pidfd (readable
when it exits); kernels without pidfd_open fall back to polling. We only ever `waitpid` pids we registered, so
library code that uses `subprocess.run` elsewhere keeps working.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

ExitCallback = Callable[[int], None]  # receives the raw wait status

POLL_FAST_S = 0.02
POLL_SLOW_S = 0.25
FAST_POLLS = 50  # about a second of fast polling, then slow: short commands end promptly, long ones cost little


class ChildReaper:
    def __init__(self) -> None:
        self._children: dict[int, ExitCallback] = {}
        self._pidfds: dict[int, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poll_handle: asyncio.TimerHandle | None = None
        self._polls = 0
        self._pidfd_ok = hasattr(os, "pidfd_open")

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
                self._pidfd_ok = False  # e.g. ENOSYS in an older sandbox kernel
            else:
                self._pidfds[pid] = fd
                loop.add_reader(fd, self._reap_one, pid)
                return
        self._polls = 0
        self._schedule_poll()

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
        callback = self._children.pop(pid, None)
        if callback is not None:
            callback(status)

    def _schedule_poll(self) -> None:
        if self._poll_handle is not None or self._loop is None:
            return
        delay = POLL_FAST_S if self._polls < FAST_POLLS else POLL_SLOW_S
        self._poll_handle = self._loop.call_later(delay, self._poll)

    def _poll(self) -> None:
        self._poll_handle = None
        self._polls += 1
        for pid in [p for p in self._children if p not in self._pidfds]:
            self._reap_one(pid)
        if any(p not in self._pidfds for p in self._children):
            self._schedule_poll()

    @property
    def pending(self) -> int:
        return len(self._children)


REAPER = ChildReaper()
