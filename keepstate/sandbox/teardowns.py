"""Teardowns: destroying runtime instances on a thread pool of their own, retried with backoff until nothing of
them is left, recorded in the catalog so a server that starts again finishes what the last one began
(docs/design/teardown.md).

An instance's slot is released only once its teardown finished (its network is gone), and its record is deleted only
when the runtime's inventory of it is empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from keepstate.db.errors import DatabaseUnavailable
from keepstate.runtime.base import Handle, Runtime

from .record import TeardownRecord
from .rows import SandboxRows
from .slots import Slots

log = logging.getLogger("keepstate.sandbox")

THREADS = 16
BACKOFF_FIRST = 1.0  # seconds before the first retry; doubled after each failure
BACKOFF_MAX = 60.0


def backoff(attempts: int) -> float:
    """Seconds until the next try after `attempts` failed ones."""
    return float(min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** max(0, attempts - 1)))


class Teardowns:
    def __init__(self, rows: SandboxRows, runtime: Runtime, slots: Slots, threads: int = THREADS) -> None:
        self.rows = rows
        self.runtime = runtime
        self.slots = slots
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, TeardownRecord] = {}
        self._running: dict[str, asyncio.Task[bool]] = {}
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.Task[None] | None = None

    def pending(self) -> int:
        """Teardowns recorded and not yet finished (in progress or waiting for a retry)."""
        return len(self._pending)

    def names(self) -> set[str]:
        return set(self._pending)

    # -- start and stop -----------------------------------------------------------------------------------------
    async def resume(self) -> None:
        """Take over the teardowns a previous server recorded (their slots stay held until each is finished) and
        start retrying: every one is tried at once."""
        for rec in await self.rows.teardowns():
            if rec.runtime_name not in self._pending:
                self._pending[rec.runtime_name] = replace(rec, next_try=0.0)
                self.slots.adopt(rec.slot)
        if self._pending:
            log.info("resuming %d unfinished teardown(s)", len(self._pending))
        self._ensure_loop()

    async def stop(self) -> None:
        """Stop retrying and wait for attempts in progress; what is unfinished stays recorded for the next server."""
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
            self._loop = None
        await asyncio.gather(*self._running.values(), return_exceptions=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- teardowns ----------------------------------------------------------------------------------------------
    async def record(self, name: str, slot: int, *, recorded: bool = False) -> None:
        """Remember a teardown to do (before the sandbox's row goes: a crash in between must leave one of them;
        `recorded`: the caller wrote it already, in the transaction that deleted the row)."""
        if not recorded:
            await self.rows.add_teardown(name, slot)
        if name not in self._pending:
            self._pending[name] = TeardownRecord(runtime_name=name, slot=slot)

    async def later(self, name: str, slot: int, *, recorded: bool = False) -> None:
        """Record the teardown and leave it to the retry loop (due at once): for callers that cannot wait."""
        await self.record(name, slot, recorded=recorded)
        self._ensure_loop()
        assert self._wake is not None
        self._wake.set()

    async def run(self, name: str, slot: int) -> bool:
        """Record the teardown and make an attempt; True once nothing is left. A failed one is retried later."""
        await self.record(name, slot)
        return await self.attempt(name)

    async def attempt(self, name: str) -> bool:
        """One attempt at a recorded teardown, or the one already in progress; True once it is finished."""
        if name not in self._pending:
            return True
        self._ensure_loop()
        return await asyncio.shield(self._task(name))

    def _task(self, name: str) -> asyncio.Task[bool]:
        task = self._running.get(name)
        if task is None:
            task = self._running[name] = asyncio.get_running_loop().create_task(self._once(name))
            task.add_done_callback(lambda _t: self._finished(name))
        return task

    def _finished(self, name: str) -> None:
        """An attempt ended: it no longer counts as running, and the retry loop looks again (at its next try, if it
        failed). Woken here, not from inside the attempt: there it would look while the attempt still ran."""
        self._running.pop(name, None)
        if self._wake is not None:
            self._wake.set()

    async def _once(self, name: str) -> bool:
        rec = self._pending[name]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="teardown")
        try:
            slot, left = await asyncio.get_running_loop().run_in_executor(self._pool, self._destroy, rec)
        except Exception as exc:  # noqa: BLE001 - any failure is retried; its message is recorded
            error = f"{type(exc).__name__}: {exc}"
        else:
            rec = replace(rec, slot=slot)
            if not left:
                try:
                    await self.rows.delete_teardown(name)
                except DatabaseUnavailable as exc:  # torn down, but still recorded: done again (a no-op) later
                    self._pending[name] = replace(rec, next_try=time.time() + backoff(1))
                    log.warning("teardown of %s done; its record stays until the database answers: %s", name, exc)
                    return False
                if rec.slot >= 0:
                    self.slots.release(rec.slot)  # only now: its network is gone and no record holds it
                self._pending.pop(name, None)
                return True
            error = "left " + ", ".join(left)
        attempts = rec.attempts + 1
        wait = backoff(attempts)
        self._pending[name] = replace(rec, attempts=attempts, next_try=time.time() + wait, last_error=error)
        try:
            await self.rows.teardown_failed(name, time.time() + wait, error)
        except DatabaseUnavailable as exc:  # the attempt count stays in memory; the record keeps the older one
            log.warning("teardown of %s: its failure is not recorded: %s", name, exc)
        log.warning("teardown of %s failed (attempt %d; next in %.0f s): %s", name, attempts, wait, error)
        return False

    def _destroy(self, rec: TeardownRecord) -> tuple[int, list[str]]:
        """On a teardown thread: destroy, then the inventory check; (the slot it stands for, what is left). A slot
        another instance holds now is left alone (-1: neither torn down nor released)."""
        slot = rec.slot if rec.slot >= 0 and self.slots.ours(rec.slot, rec.runtime_name) else -1
        handle = Handle(rec.runtime_name, slot)
        self.runtime.destroy(handle)
        return slot, [f"{r.kind} {r.where}" for r in self.runtime.remains(handle)]

    # -- retries ------------------------------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop is None or self._loop.done():
            self._wake = asyncio.Event()
            self._loop = asyncio.get_running_loop().create_task(self._retry_loop(), name="teardowns")

    async def _retry_loop(self) -> None:
        assert self._wake is not None
        while True:
            now = time.time()
            waiting = [r for r in self._pending.values() if r.runtime_name not in self._running]
            for rec in waiting:
                if rec.next_try <= now:
                    self._task(rec.runtime_name)
            later = [r.next_try for r in waiting if r.next_try > now]
            self._wake.clear()
            # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancellation that arrives as the event is
            # set (gh-86296), and stop() would then wait for this loop forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.05, min(later, default=now + 60) - now)):
                    await self._wake.wait()

