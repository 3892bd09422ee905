"""The sandbox table: the one owner of this server's sandboxes' records, and the one executor of their lifecycle.

Nothing else writes a sandbox's state. A command on a sandbox runs as

    async with table.command(sandbox_id, Command.PAUSE) as step:
        ...                      # act on step.row (its transient state is written already)
        await step.done()        # optional: the success state, written now (else when the block ends)
        ...                      # what follows the transition (history events), still under the lock

The executor takes the sandbox's lock, re-reads its record, looks (command, state) up in state.TRANSITIONS (an
illegal pair raises the client's 404 or 409), runs `admit` (a check that must see the state before the transient
one: admission counts RESUMING as a place already held), writes the transient state, lets the body act, and writes
the state on success, or on failure if the body raised. A body that decides to become another command (a timeout
that pauses or kills) hands over with `step.then(command)`, which runs that command's transition under the same
lock. A success of KILLED removes the record; the body deleted its row (with its teardown, in one transaction).

A write of the state on failure that the database refuses (it went away) is kept in memory and retried in the
background with backoff until it lands: the sandbox's state on this server is the failure state at once, and the
database catches up (never a sandbox shown running here and pausing in the database forever).

Sandboxes enter the table by `claim` (a create: CREATE's transition from POOLED) or `enter` (a fork's child, a
sandbox loaded from the store, one adopted at start: rows born in their state), and leave by a KILLED transition
or `drop` (a server that stops with reap). `amend` (then `save`) changes a record's fields that are
not its state (a retired instance forgotten), under the lock. Readers use the query methods; `lock`/`try_lock`
are for the two housekeepers that must not run beside a command (the idle freezer, standby release).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable

from keepstate.db.errors import DatabaseUnavailable
from keepstate.errors import NotFound

from .record import SandboxRow
from .rows import SandboxRows
from .state import PUBLIC, Command, State, Transition, listed, transition

log = logging.getLogger("keepstate.sandbox.table")

RETRY_FIRST = 0.5  # seconds before a failed failure-state write is tried again; doubled up to RETRY_MAX
RETRY_MAX = 30.0


class Step:
    """One command's passage through its transition: the row it acts on, and when its success is written."""

    def __init__(self, table: SandboxTable, row: SandboxRow, move: Transition) -> None:
        self.table, self.row, self.move = table, row, move
        self.origin = row.state  # the stable state it started from
        self.finished = False  # its end state is written (by done(), or by a command it handed over to)

    async def done(self) -> None:
        """Write the success state now: what the body does after this runs with the sandbox in it."""
        if not self.finished:
            self.finished = True
            await self.table._end(self.row, self.move.success)

    @contextlib.asynccontextmanager
    async def then(self, command: Command) -> AsyncIterator[Step]:
        """Become `command`: its transition from the current state, under the lock this step holds."""
        self.finished = True  # this step ends in whatever state the next one leaves
        async with self.table._transition(self.row, command) as step:
            yield step


class SandboxTable:
    def __init__(self, rows: SandboxRows) -> None:
        self.rows = rows
        self._records: dict[str, SandboxRow] = {}  # every sandbox of this server's (listed or transient), by ID
        # Weak: a sandbox's lock lives while a command holds or awaits it, so killed sandboxes leave none behind.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._retries: set[asyncio.Task[None]] = set()

    # -- reading ------------------------------------------------------------------------------------------------
    def get(self, sandbox_id: str) -> SandboxRow:
        """A listed sandbox (running, paused, on their way); NotFound otherwise."""
        row = self._records.get(sandbox_id)
        if row is None or not listed(row.state):
            raise NotFound(f"sandbox \"{sandbox_id}\" not found")
        return row

    def find(self, sandbox_id: str) -> SandboxRow | None:
        """Its record in any state this table holds, or None."""
        return self._records.get(sandbox_id)

    def __contains__(self, sandbox_id: object) -> bool:
        return sandbox_id in self._records

    def all(self) -> list[SandboxRow]:
        return list(self._records.values())

    def listed(self) -> list[SandboxRow]:
        return [r for r in self._records.values() if listed(r.state)]

    async def cluster_listed(self) -> list[SandboxRow]:
        """The listed sandboxes of every node of the database: this node's as it holds them, the others' rows (a
        list through any node of a cluster shows them all)."""
        here = self.listed()
        known = {r.sandbox_id for r in here}
        return here + [r for r in await self.rows.others(tuple(PUBLIC)) if r.sandbox_id not in known]

    def running(self) -> list[SandboxRow]:
        return [r for r in self._records.values() if r.state in (State.RUNNING, State.CHECKPOINTING)]

    def volume_users(self, volume_id: str) -> list[str]:
        """The listed sandboxes (running, paused, on their way) that mount a volume."""
        return [r.sandbox_id for r in self.listed()
                if any(m.get("volume_id") == volume_id for m in r.settings.volume_mounts)]

    def route(self, sandbox_id: str) -> SandboxRow | None:
        """The sandbox a data-plane request may reach now, or None (the router answers 502)."""
        row = self._records.get(sandbox_id)
        if row is None or row.state not in (State.RUNNING, State.CHECKPOINTING) or not row.address:
            return None
        return row

    # -- locks --------------------------------------------------------------------------------------------------
    def lock(self, sandbox_id: str) -> asyncio.Lock:
        lock = self._locks.get(sandbox_id)
        if lock is None:
            lock = self._locks[sandbox_id] = asyncio.Lock()
        return lock

    def command_running(self, sandbox_id: str) -> bool:
        """Whether a command holds or awaits the sandbox's lock."""
        lock = self._locks.get(sandbox_id)
        return lock is not None and lock.locked()

    @contextlib.asynccontextmanager
    async def try_lock(self, sandbox_id: str) -> AsyncIterator[bool]:
        """Hold the sandbox's lock if nothing holds or awaits it (True), else hold nothing (False): for work that
        gives way to commands instead of waiting for them. Acquiring a free asyncio.Lock does not suspend, so no
        command can slip in between the look and the hold."""
        lock = self.lock(sandbox_id)
        if lock.locked():
            yield False
            return
        async with lock:
            yield True

    # -- the executor -------------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def command(self, sandbox_id: str, command: Command,
                      admit: Callable[[SandboxRow], Awaitable[None]] | None = None) -> AsyncIterator[Step]:
        async with self.lock(sandbox_id):
            row = self._records.get(sandbox_id)
            if row is None:
                raise NotFound(f"sandbox \"{sandbox_id}\" not found")
            transition(command, row.state, sandbox_id)  # refused before admit looks
            if admit is not None:
                await admit(row)
            async with self._transition(row, command) as step:
                yield step

    @contextlib.asynccontextmanager
    async def _transition(self, row: SandboxRow, command: Command) -> AsyncIterator[Step]:
        move = transition(command, row.state, row.sandbox_id)
        step = Step(self, row, move)
        if move.transient is not None:
            await self._write(row, move.transient)  # refused (the database is away): nothing changed
        try:
            yield step
        except BaseException:
            if not step.finished:
                step.finished = True
                await self._fail(row, move.failure)
            raise
        await step.done()

    async def _end(self, row: SandboxRow, state: State) -> None:
        if state == State.KILLED:
            row.state = State.KILLED
            self._records.pop(row.sandbox_id, None)
            return
        await self._write(row, state)

    async def _write(self, row: SandboxRow, state: State) -> None:
        before = row.state
        row.state = state
        try:
            await self.rows.put(row)
        except BaseException:
            row.state = before
            raise

    async def _fail(self, row: SandboxRow, state: State) -> None:
        """The state on failure: at once here, in the database as soon as it takes it."""
        row.state = state
        try:
            await self.rows.put(row)
        except (Exception, asyncio.CancelledError) as exc:  # the body's own exception goes on, not this one
            log.warning("sandbox %s: its state %s is not in the database yet (%r); retrying", row.sandbox_id,
                        state, exc)
            task = asyncio.get_running_loop().create_task(self._retry(row, state))
            self._retries.add(task)
            task.add_done_callback(self._retries.discard)

    async def _retry(self, row: SandboxRow, state: State) -> None:
        delay = RETRY_FIRST
        while True:
            await asyncio.sleep(delay)
            async with self.lock(row.sandbox_id):
                if self._records.get(row.sandbox_id) is not row or row.state != state:
                    return  # a later command wrote it since
                try:
                    await self.rows.put(row)
                    log.info("sandbox %s: its state %s is in the database now", row.sandbox_id, state)
                    return
                except DatabaseUnavailable:
                    delay = min(delay * 2, RETRY_MAX)
                except Exception:
                    log.exception("sandbox %s: writing its state %s failed; not retried", row.sandbox_id, state)
                    return

    # -- entering and leaving -----------------------------------------------------------------------------------
    async def claim(self, row: SandboxRow, write: Callable[[], Awaitable[None]]) -> None:
        """A pooled sandbox taken by a create: CREATE's transition, written by `write` (which replaces the pooled
        row by the user's, in one transaction); it is listed once that has succeeded, and stays pooled if not."""
        move = transition(Command.CREATE, row.state, row.sandbox_id)
        row.state = move.success
        try:
            await write()
        except BaseException:
            row.state = move.failure
            raise
        self._records[row.sandbox_id] = row

    def enter(self, row: SandboxRow) -> None:
        """A sandbox whose row is written already takes its place: born running (a fork's child, written by the
        restore before its agent answered, so that a crash reaps it), loaded paused from the shared store, or
        adopted at start (adopt.py)."""
        assert row.state in (State.RUNNING, State.PAUSED), row.state
        self._records[row.sandbox_id] = row

    def forget(self, sandbox_id: str) -> None:
        """A record dropped without a write: its row is another node's now (sandbox/fencing.py)."""
        self._records.pop(sandbox_id, None)

    def drop(self) -> None:
        """Every record, forgotten: a server stopping with reap has torn their instances down."""
        self._records = {}

    @contextlib.asynccontextmanager
    async def amend(self, sandbox_id: str) -> AsyncIterator[SandboxRow | None]:
        """The record (None: gone meanwhile) under its lock, for a change of fields that are not its state; the
        block writes what it changed with `save`, and only then."""
        async with self.lock(sandbox_id):
            yield self._records.get(sandbox_id)

    async def save(self, row: SandboxRow) -> None:
        """Write the fields a command's body changed, its state unchanged (under the command's lock)."""
        await self.rows.put(row)

    async def close(self) -> None:
        for task in list(self._retries):
            task.cancel()
        await asyncio.gather(*self._retries, return_exceptions=True)
