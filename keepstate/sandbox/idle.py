"""The idle freezer: a sandbox nobody has called for `freeze_idle_after` seconds, and that does nothing itself, is
frozen (its host cgroup: no CPU at all), and thawed transparently before anything reaches it (docs/design/idle.md).

Every INTERVAL it looks at each running (and pooled) sandbox that is quiet: no call or proxied request through the
AgentClient for `after` seconds, none in flight, no command holding its lock, not quiesced. For those it asks the
agent (`GET /keepstate/idle`, a poll: not activity); if the agent says idle, and the journal poller has pulled
every entry the agent holds, it closes the router's idle keep-alive connections into it, waits for the closes to
finish (the host's TCP table, read every SETTLE, for at most SETTLE_MAX), and then, holding the sandbox's lock
(taken only if no command holds or awaits it: the freezer gives way to commands) and with no await in between, so
that no call can start meanwhile, checks again that nothing started, that the host holds no TCP
connection to the sandbox in any state but TIME_WAIT or CLOSE (a connection closed while the sandbox is frozen
leaves the host's FIN unacknowledged; killed frozen, the host retransmits it for minutes into the slot's address,
which the slot's next sandbox inherits), and freezes it.

The AgentClient calls `wake` before every call, proxied request and quiesce: a frozen sandbox is thawed there, a
file write of well under a millisecond, on the event loop. Polls (journal, metrics, these looks) skip frozen
sandboxes instead (`frozen`).

Why a quiet sandbox stays unfrozen is kept (`held_back`) and logged at DEBUG, and at INFO once per reason when it has
been quiet for HELD_LOG_S: a sandbox that never freezes says why in the server's log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp

from keepstate.runtime.base import Handle, RuntimeFailure
from keepstate.session.journal import JournalBusy, JournalError

from .agent_client import Quiesced
from .instances import handle_of
from .record import SandboxRow
from .state import State
from .tcp_table import host_tcp_open, settled

if TYPE_CHECKING:
    from .manager import SandboxManager

log = logging.getLogger("keepstate.sandbox.idle")

INTERVAL = 1.0  # seconds between rounds; the agent compares looks at least a second apart
SETTLE = 0.05  # after closing our keep-alive connections: how often the host's TCP table is read again
SETTLE_MAX = 2.0  # how long the sandbox may take to answer their FINs before this look gives up
HELD_LOG_S = 20.0  # quiet this long and still not frozen: the reason is logged at INFO (once per reason)
MAX_BACKOFF = 16.0  # a sandbox that keeps itself busy is looked at no more often than this
CONCURRENCY = 8  # looks in flight at once
DEFAULT_AFTER = 2.0


@dataclass
class _Frozen:
    handle: Handle
    session_id: str


@dataclass
class _Looks:
    due: float = 0.0  # monotonic time of the next look
    backoff: float = 0.0
    active: float = 0.0  # the activity mark the backoff was computed for
    seen: float = field(default_factory=time.monotonic)  # when the freezer first looked (a pool's never called)
    held: str = ""  # why the last look did not freeze it
    told: str = ""  # the reason last logged at INFO


class IdleFreezer:
    def __init__(self, m: SandboxManager, after: float = DEFAULT_AFTER) -> None:
        self.m = m
        self.after = after
        self.froze = 0  # freezes so far (tests, logs)
        self._frozen: dict[str, _Frozen] = {}  # by sandbox ID
        self._sessions: set[str] = set()  # session IDs of frozen sandboxes (the journal poller's keys)
        self._looks: dict[str, _Looks] = {}  # by sandbox ID, while it is not frozen
        m.agents.waker = self.wake
        m.agents.asleep = self.frozen
        if m.recorder.poller is not None:
            m.recorder.poller.asleep = self.frozen

    @property
    def enabled(self) -> bool:
        return self.after > 0

    def frozen(self, sandbox_or_session_id: str) -> bool:
        return sandbox_or_session_id in self._frozen or sandbox_or_session_id in self._sessions

    def frozen_ids(self) -> list[str]:
        return sorted(self._frozen)

    def held_back(self, sandbox_id: str) -> str | None:
        """Why the freezer's last look at this quiet sandbox did not freeze it; None if it has not said."""
        looks = self._looks.get(sandbox_id)
        return (looks.held or None) if looks is not None else None

    def wake(self, sandbox_id: str) -> None:
        """Thaw the sandbox if we froze it (the AgentClient's waker: synchronous, before any connection)."""
        entry = self._frozen.pop(sandbox_id, None)
        if entry is None:
            return
        self._sessions.discard(entry.session_id)
        self._looks.pop(sandbox_id, None)
        try:
            self.m.runtime.idle_thaw(entry.handle)
        except Exception as exc:  # a sandbox gone meanwhile: the call that woke it will find out
            log.warning("thaw of %s (%s) failed: %s", sandbox_id, entry.handle.name, exc)

    def forget(self, sandbox_id: str) -> None:
        """A frozen sandbox being killed: drop it without thawing. Its teardown SIGKILLs its processes and only then
        thaws them (runtime/cgroups.py kill), so they die at once instead of running on first: a kill of 300 frozen
        sandboxes that thawed each as it was asked made all 300 runnable together and starved the host."""
        entry = self._frozen.pop(sandbox_id, None)
        if entry is not None:
            self._sessions.discard(entry.session_id)
        self._looks.pop(sandbox_id, None)

    def wake_all(self) -> None:
        for sandbox_id in list(self._frozen):
            self.wake(sandbox_id)

    # -- the loop -------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            try:
                await self.round()
            except Exception:
                log.exception("idle freezer round failed")
            await asyncio.sleep(INTERVAL)

    def _candidates(self) -> list[tuple[SandboxRow, bool]]:
        rows = [(r, False) for r in self.m.running()]
        rows += [(r, True) for p in self.m.pools.values() for r in p.ready()]
        return rows

    async def round(self) -> None:
        rows = self._candidates()
        present = {r.sandbox_id: r for r, _ in rows}
        for sandbox_id, entry in list(self._frozen.items()):
            row = present.get(sandbox_id)
            if row is None or row.runtime_name != entry.handle.name:
                self.wake(sandbox_id)  # killed or replaced (its teardown thaws it too): forget it
        for sandbox_id in set(self._looks) - set(present):
            del self._looks[sandbox_id]
        now = time.monotonic()
        due = [(r, pooled) for r, pooled in rows if self._quiet(r, pooled, now) and self._due(r.sandbox_id, now)]
        if due:
            limit = asyncio.Semaphore(CONCURRENCY)
            await asyncio.gather(*(self._consider(r, pooled, limit) for r, pooled in due))

    def _due(self, sandbox_id: str, now: float) -> bool:
        looks = self._looks.setdefault(sandbox_id, _Looks())
        active = self.m.agents.last_active(sandbox_id)
        if active != looks.active:  # it was used since: look again from the start
            looks.due, looks.backoff, looks.active = 0.0, 0.0, active
        return now >= looks.due

    def _later(self, sandbox_id: str, seconds: float | None = None) -> None:
        looks = self._looks.setdefault(sandbox_id, _Looks())
        if seconds is None:
            looks.backoff = min(max(looks.backoff * 2, INTERVAL), MAX_BACKOFF)
            seconds = looks.backoff
        looks.due = time.monotonic() + seconds

    def _quiet(self, row: SandboxRow, pooled: bool, now: float, held: bool = False) -> bool:
        """Whether nothing runs into the sandbox now and nothing has for `after` seconds (synchronous). `held`:
        the freezer holds the sandbox's lock itself (no command can)."""
        sid, agents = row.sandbox_id, self.m.agents
        if sid in self._frozen or not row.runtime_name or not row.address:
            return False
        if pooled:
            if not any(r is row for p in self.m.pools.values() for r in p.ready()):
                return False
        elif self.m.table.find(sid) is not row or row.state != State.RUNNING:
            return False
        return ((held or not self.m.command_running(sid)) and not agents.quiesced(sid) and not agents.busy(sid)
                and now - agents.last_active(sid) >= self.after)

    async def _consider(self, row: SandboxRow, pooled: bool, limit: asyncio.Semaphore) -> None:
        sid = row.sandbox_id
        async with limit:
            try:
                answer = await self.m.agents.idle(sid, row.address, row.access_token)
            except (Quiesced, RuntimeFailure, aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                self._hold(sid, f"the idle look failed: {exc!r}")
                self._later(sid)
                return
            if not answer.get("idle"):
                first = answer.get("why") == "first look"
                self._hold(sid, f"its agent says it is not idle: {answer.get('why')}")
                self._later(sid, INTERVAL if first else None)
                return
            if not pooled and not await self._journal_pulled(row, answer.get("last")):
                self._hold(sid, "its journal is not pulled yet")
                self._later(sid, INTERVAL)
                return
            await self.m.agents.close_pool(sid)
            await self._settled(row.address)
        # The freeze holds the sandbox's lock, taken only if no command holds or awaits it: a command that comes
        # meanwhile waits for the freeze and finds the sandbox frozen (its calls thaw it). Calls and proxied
        # requests take no lock: from the look below to the freeze nothing awaits, so none can start in between.
        async with self.m.table.try_lock(sid) as held:
            if not held:
                self._hold(sid, "a command holds it")
                return
            if not self._quiet(row, pooled, time.monotonic(), held=True) or self.m.agents.has_pool(sid):
                return
            tcp = host_tcp_open(row.address)
            if tcp:
                self._hold(sid, f"the host holds TCP connections to it (states {tcp})")
                self._later(sid, INTERVAL)
                return
            handle = handle_of(row)
            try:
                self.m.runtime.idle_freeze(handle)
            except RuntimeFailure as exc:
                log.warning("freezing idle sandbox %s failed: %s", sid, exc)
                self._hold(sid, f"the freeze failed: {exc}")
                self._later(sid)
                return
            self._frozen[sid] = _Frozen(handle, row.session_id)
            if not pooled:
                self._sessions.add(row.session_id)
            self._looks.pop(sid, None)  # looked at afresh once thawed
            self.froze += 1
            log.debug("froze idle sandbox %s (%s)", sid, row.runtime_name)

    async def _settled(self, address: str) -> None:
        """Until the host holds no TCP connection to `address` but closed ones, or SETTLE_MAX passes: the sandbox
        answers the FINs of the connections just closed, slowly on a loaded host. (Looking again a round later
        instead never ends for a sandbox slower than one SETTLE: every look opens and closes a connection too.)"""
        await settled(address, SETTLE_MAX, SETTLE, probe=lambda a: host_tcp_open(a))

    def _hold(self, sid: str, why: str) -> None:
        """Note why a quiet sandbox was not frozen: at DEBUG, and at INFO once per reason when it has been quiet for
        HELD_LOG_S."""
        looks = self._looks.get(sid)
        if looks is None:  # thawed or gone while it was looked at: nothing is held back
            log.debug("not freezing %s: %s (and it was woken or went meanwhile)", sid, why)
            return
        looks.held = why
        quiet = time.monotonic() - max(self.m.agents.last_active(sid), looks.seen)
        if quiet >= HELD_LOG_S and looks.told != why:
            looks.told = why
            log.info("sandbox %s, quiet for %.0f s, is not frozen: %s", sid, quiet, why)
        else:
            log.debug("not freezing %s: %s", sid, why)

    async def _journal_pulled(self, row: SandboxRow, last: object) -> bool:
        """Whether the journal poller holds every entry up to the agent's `last` (pulling now if not)."""
        poller = self.m.recorder.poller
        session = row.session_id
        if poller is None or session not in poller.tracked() or not isinstance(last, int):
            return True
        if (poller.cursor(session) or 0) >= last:
            return True
        try:
            await poller.pull_now(session)
        except (JournalError, JournalBusy, KeyError, TimeoutError) as exc:
            log.debug("journal pull of %s before a freeze failed: %s", session, exc)
            return False
        return (poller.cursor(session) or 0) >= last
