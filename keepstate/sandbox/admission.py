"""Admission: how many instance starts run at once, and how many sandboxes a host and an API key may hold
(docs/design/admission.md).

`StartQueue` hands out start slots: K at once, up to Q user starts waiting first come first served for at most W
seconds, pool refills behind every user start. `Places` reserves places against the limits before a start; the
counts of what already holds a place come from the manager's records (callables), so a place is never counted
twice nor lost between the reservation and the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from keepstate.config import (
    MAX_SANDBOXES_PER_KEY,
    START_WAIT_SECONDS,
    default_max_sandboxes,
    default_max_starts,
    default_start_queue,
)
from keepstate.errors import Busy, Full, TooMany, Unavailable

RECENT_STARTS = 20  # the start durations the Retry-After estimate averages
FIRST_GUESS = 2.0  # seconds a start takes, until one has been measured
MAX_RETRY_AFTER = 60
FULL_RETRY_AFTER = 5  # a full host: about when a short-lived sandbox ends (no estimate is possible)


@dataclass(frozen=True)
class AdmissionConfig:
    """`keepstate serve`'s --max-starts, --start-queue, --start-wait, --max-sandboxes, --max-sandboxes-per-key;
    None: the default (keepstate/config.py)."""

    max_starts: int | None = None
    start_queue: int | None = None
    start_wait: float = START_WAIT_SECONDS
    max_sandboxes: int | None = None
    max_sandboxes_per_key: int = MAX_SANDBOXES_PER_KEY

    def start_queue_for(self) -> StartQueue:
        k = self.max_starts or default_max_starts()
        return StartQueue(k, default_start_queue(k) if self.start_queue is None else self.start_queue,
                          self.start_wait)

    def host_limit(self, network_slots: int) -> int:
        return default_max_sandboxes(network_slots) if self.max_sandboxes is None else self.max_sandboxes


class StartQueue:
    def __init__(self, max_starts: int, queue: int, wait: float) -> None:
        if max_starts < 1 or queue < 0 or wait < 0:
            raise ValueError("max_starts must be at least 1, queue and wait at least 0")
        self.max_starts, self.queue, self.wait = max_starts, queue, wait
        self.running = 0
        self.refused = 0
        self._users: deque[asyncio.Future[None]] = deque()
        self._refills: deque[asyncio.Future[None]] = deque()
        self._durations: deque[float] = deque(maxlen=RECENT_STARTS)
        self._closed = False

    @property
    def waiting(self) -> int:
        return len(self._users)

    @contextlib.asynccontextmanager
    async def slot(self, refill: bool = False) -> AsyncIterator[None]:
        """Hold a start slot for the body. A user start may be refused (Busy); a refill waits as long as it takes."""
        await self._acquire(refill)
        started = time.monotonic()
        try:
            yield
        finally:
            self._durations.append(time.monotonic() - started)
            self._release()

    def retry_after(self) -> int:
        """When a start refused now would find room: the queue ahead of it drained at the recent rate."""
        mean = sum(self._durations) / len(self._durations) if self._durations else FIRST_GUESS
        return max(1, min(MAX_RETRY_AFTER, math.ceil(mean * (len(self._users) + 1) / self.max_starts)))

    def close(self) -> None:
        """The server stops: every waiter is told so (a pool's refill must not wait forever)."""
        self._closed = True
        for fut in (*self._users, *self._refills):
            if not fut.done():
                fut.set_exception(Unavailable("the server is stopping"))
        self._users.clear()
        self._refills.clear()

    def figures(self) -> dict[str, Any]:
        return {"running": self.running, "waiting": len(self._users), "refillsWaiting": len(self._refills),
                "limit": self.max_starts, "queue": self.queue, "waitSeconds": self.wait, "refused": self.refused,
                "retryAfter": self.retry_after()}

    # -- inside -------------------------------------------------------------------------------------------------
    async def _acquire(self, refill: bool) -> None:
        if self._closed:
            raise Unavailable("the server is stopping")
        ahead = self._users if not refill else (*self._users, *self._refills)
        if self.running < self.max_starts and not ahead:
            self.running += 1
            return
        if refill:
            await self._wait_in(self._refills, None)
            return
        if len(self._users) >= self.queue:
            raise self._busy()
        if not await self._wait_in(self._users, self.wait):
            raise self._busy()

    async def _wait_in(self, line: deque[asyncio.Future[None]], timeout: float | None) -> bool:
        """Wait for a slot handed over by _release; False if `timeout` passed first (the place in line is given up)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        line.append(fut)
        try:
            await asyncio.wait({fut}, timeout=timeout)
        except BaseException:  # cancelled (the client went away): a slot handed over meanwhile goes on
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release()
            else:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    line.remove(fut)
            raise
        if fut.done():
            fut.result()  # raises if the queue was closed
            return True
        fut.cancel()
        line.remove(fut)
        return False

    def _release(self) -> None:
        for line in (self._users, self._refills):  # users first: a refill never takes a slot a user waits for
            while line:
                fut = line.popleft()
                if not fut.done():
                    fut.set_result(None)  # the slot passes on: `running` stays
                    return
        self.running -= 1

    def _busy(self) -> Busy:
        self.refused += 1
        seconds = self.retry_after()
        return Busy(f"this host is busy starting sandboxes ({self.running} starting, {len(self._users)} waiting, "
                    f"at most {self.max_starts} at once); retry in {seconds} s", retry_after=seconds,
                    error_code="sandbox_capacity_unavailable")


@dataclass
class Reservation:
    """Places held for starts under way: `host` instances on this host, `key` running sandboxes of `key_id`."""

    key_id: str | None
    host: int
    key: int


class Places:
    """Places against the host's and each API key's limits. `on_host()` and `running_of(key_id)` count what the
    records hold; reservations add the starts under way, until `held()` hands them to their records."""

    def __init__(self, max_sandboxes: int, per_key: int, on_host: Callable[[], int],
                 running_of: Callable[[str], int], key_limit: Callable[[str], tuple[str, int | None]]) -> None:
        self.max_sandboxes, self.per_key = max_sandboxes, per_key
        self._on_host, self._running_of, self._key_limit = on_host, running_of, key_limit
        self._reserved: list[Reservation] = []

    def on_host(self) -> int:
        return self._on_host() + sum(r.host for r in self._reserved)

    def running_of(self, key_id: str) -> int:
        return self._running_of(key_id) + sum(r.key for r in self._reserved if r.key_id == key_id)

    def limit_of(self, key_id: str) -> tuple[str, int]:
        """The key's name and its limit of running sandboxes (0: none)."""
        name, own = self._key_limit(key_id)
        return name, self.per_key if own is None else own

    def room(self) -> bool:
        """Whether one more instance fits on the host (a pool's refill asks, and counts itself in the same step)."""
        return not self.max_sandboxes or self.on_host() < self.max_sandboxes

    def check(self, key_id: str | None, host: int, key: int, check_host: bool = True) -> None:
        """Refuse unless `host` more instances and `key` more running sandboxes of `key_id` fit."""
        if check_host and host and self.max_sandboxes and self.on_host() + host > self.max_sandboxes:
            more = f"{host} more" if host > 1 else "another"
            raise Full(f"this host holds its limit of {self.max_sandboxes} sandboxes (--max-sandboxes, running, "
                       f"paused in memory and pre-started ones counted): {more} cannot start; kill some, or retry "
                       "later", retry_after=FULL_RETRY_AFTER)
        if key and key_id is not None:
            name, limit = self.limit_of(key_id)
            running = self.running_of(key_id)
            if limit and running + key > limit:
                asked = f"{key} more" if key > 1 else "another"
                raise TooMany(f"API key '{name}' has reached its limit of {limit} running sandboxes ({running} "
                              f"running, {asked} asked for); kill or pause some, or ask the operator to raise it "
                              f"(`keepstate keys limit {name} N`)")

    @contextlib.contextmanager
    def reserve(self, key_id: str | None, host: int = 1, key: int = 1,
                check_host: bool = True) -> Iterator[Reservation]:
        """Check and hold places while the body starts instances; they are given back when it ends (on success the
        records hold them by then: the body lists its records in the same step as it exits). `check_host=False`
        holds a host place without checking it: a claimed pooled instance, counted already, moving to a record."""
        self.check(key_id, host, key, check_host)
        r = Reservation(key_id, host, key)
        self._reserved.append(r)
        try:
            yield r
        finally:
            self._reserved.remove(r)

    def figures(self) -> dict[str, Any]:
        return {"onHost": self.on_host(), "limit": self.max_sandboxes, "perKeyLimit": self.per_key}
