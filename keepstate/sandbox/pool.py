"""Warm pools: sandboxes started ahead of demand, one pool per template build.

A create takes a pooled sandbox (its agent already answering) and only has to initialise
it, which is what makes create-to-first-command fast. Pools refill in the background, and a refill waits while
creates keep taking from a pool that still holds at least half its size (QUIET_S): a restore costs a few hundred ms
of CPU, and run during a burst of creates it competes with the first commands of the sandboxes just handed out
(docs/design/command-path.md). A pool below half its size refills at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

from .record import SandboxRow

log = logging.getLogger("keepstate.pool")
FULL_RETRY = 1.0  # seconds between looks for room on a host that holds its limit
QUIET_S = 0.5  # a refill of a pool at least half full waits until no create has taken from it for this long


class WarmPool:
    """Sandboxes of one template (or one built template's checkpoint) started ahead of demand, for creates to
    claim; refilled in the background."""

    def __init__(self, key: str, size: int, start: Callable[[], Awaitable[SandboxRow]], template: str = "",
                 room: Callable[[], bool] = lambda: True) -> None:
        self.key = key
        self._room = room  # whether the host has a place for one more (admission.py); checked before each start
        self.template = template
        self.size = size
        self._start = start
        self._ready: deque[SandboxRow] = deque()
        self._starting = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._inflight: asyncio.Future[SandboxRow] | None = None
        self.failures = 0
        self.full = False
        self.claims = 0  # sandboxes taken from it (/health reports it per template)
        self._last_take = float("-inf")  # event-loop time of the last take

    def adopt(self, row: SandboxRow) -> None:
        self._ready.append(row)

    def take(self) -> SandboxRow | None:
        row = self._ready.popleft() if self._ready else None
        self.claims += row is not None
        self._last_take = asyncio.get_running_loop().time()
        self._wake.set()
        return row

    def drain(self) -> list[SandboxRow]:
        rows = list(self._ready)
        self._ready.clear()
        return rows

    def ready(self) -> list[SandboxRow]:
        """The sandboxes ready in the pool (the idle freezer freezes them too)."""
        return list(self._ready)

    def names(self) -> list[str]:
        """The runtime names of the sandboxes ready in the pool."""
        return [r.runtime_name for r in self._ready]

    def __len__(self) -> int:
        return len(self._ready)

    @property
    def starting(self) -> int:
        """Refills under way: counted on the host from before they start until they are ready."""
        return self._starting

    def start(self) -> None:
        if self._task is None and self.size > 0:
            self._task = asyncio.get_running_loop().create_task(self._fill(), name=f"pool-{self.key}")

    async def stop(self) -> None:
        """Stop filling. A start already under way is let finish (cancelling it mid-`runsc run` would leave a
        sandbox nobody knows about); what it produced joins the pool, where the caller can drain it."""
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        if self._inflight is not None:
            try:
                self._ready.append(await self._inflight)
            except Exception:
                pass
            self._inflight = None

    def hold(self, now: float) -> float:
        """How long a refill waits at event-loop time `now`: while creates keep taking from a pool that still
        holds at least half its size, until QUIET_S have passed since the last take; else not at all."""
        if len(self._ready) * 2 < self.size:
            return 0.0
        return max(0.0, self._last_take + QUIET_S - now)

    async def _quiet(self) -> None:
        loop = asyncio.get_running_loop()
        while (left := self.hold(loop.time())) > 0:
            await asyncio.sleep(left)

    async def _fill(self) -> None:
        while True:
            while len(self._ready) + self._starting < self.size:
                await self._quiet()
                if len(self._ready) + self._starting >= self.size:
                    break
                if not self._room():  # the host holds its limit: look again in a second, counting nothing
                    if not self.full:
                        log.info("pool %s: the host holds its limit of sandboxes; refilling when it has room",
                                 self.key)
                    self.full = True
                    await asyncio.sleep(FULL_RETRY)
                    continue
                self.full = False
                self._starting += 1  # in the same step as the check: counted on the host from here
                try:
                    self._inflight = asyncio.ensure_future(self._start())
                    row = await asyncio.shield(self._inflight)
                    self._inflight = None
                    self._ready.append(row)
                    self.failures = 0
                    continue
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # keep serving; back off and try again
                    self._inflight = None
                    self.failures += 1
                    log.warning("pool %s: start failed (%s)", self.key, exc)
                finally:
                    self._starting -= 1
                # Not counted as starting while it backs off: it holds no place on the host (admission.py).
                await asyncio.sleep(min(30.0, 0.5 * 2 ** min(self.failures, 6)))
            self._wake.clear()
            await self._wake.wait()
