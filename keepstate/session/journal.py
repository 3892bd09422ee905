"""Pulling the in-sandbox agent's journal into sessions' event logs.

The agent serves `GET /journal?after=<seq>&limit=<n>` (header X-Access-Token) answering
`{"events": [{"seq", "ts", "kind", "data"}], "next": <last seq>, "oldest": <oldest seq held>}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from keepstate.db.errors import DatabaseUnavailable

from .log import EventLog

log = logging.getLogger("keepstate.session.journal")

PAGE = 500
MAX_PAGES = 100  # per pull: a runaway agent cannot keep one pull going forever
TIMEOUT = aiohttp.ClientTimeout(total=10)


class JournalError(RuntimeError):
    """The agent's journal answered something we cannot use (status, shape)."""


Page = tuple[list[tuple[int, str, dict[str, Any]]], int, int | None, int | None]


def parse_page(body: Any, after: int) -> Page:
    """Validate one journal page; returns ([(seq, kind, data with agent_seq/agent_ts)], next, oldest, last).

    Entries at or before `after` are dropped (an agent may repeat the boundary entry); seqs must increase.
    """
    if not isinstance(body, dict) or not isinstance(body.get("events"), list):
        raise JournalError("journal answer is not an object with an 'events' list")
    out: list[tuple[int, str, dict[str, Any]]] = []
    last = after
    for i, entry in enumerate(body["events"]):
        if not isinstance(entry, dict):
            raise JournalError(f"journal entry #{i} is not an object")
        seq, kind, data, ts = entry.get("seq"), entry.get("kind"), entry.get("data", {}), entry.get("ts")
        if not isinstance(seq, int) or not isinstance(kind, str) or not kind or not isinstance(data, dict):
            raise JournalError(f"journal entry #{i} lacks an integer seq, a kind or an object data")
        if seq <= last:
            if seq <= after:
                continue
            raise JournalError(f"journal entry seqs go backwards at #{i} ({seq} after {last})")
        out.append((seq, kind, {**data, "agent_seq": seq, "agent_ts": ts}))
        last = seq
    nxt = body.get("next", last)
    oldest = body.get("oldest")
    if not isinstance(nxt, int) or nxt < last:
        nxt = last
    newest = body.get("last")
    return out, nxt, oldest if isinstance(oldest, int) else None, newest if isinstance(newest, int) else None


Fetch = Callable[[str, str, str, int, int], Awaitable[tuple[int, Any]]]
"""(session_id, agent_url, token, after, limit) -> (HTTP status, body: JSON if 200, else text). The server's is
AgentClient.journal, which refuses (JournalBusy) while the sandbox is being checkpointed."""


class JournalBusy(Exception):
    """The agent must not be called right now (its sandbox is being checkpointed): skip, it is not a failure."""


def session_fetch(http: aiohttp.ClientSession) -> Fetch:
    """A Fetch over a plain aiohttp session (tests, tools)."""

    async def fetch(session_id: str, agent_url: str, token: str, after: int, limit: int) -> tuple[int, Any]:
        async with http.get(agent_url.rstrip("/") + "/journal", params={"after": str(after), "limit": str(limit)},
                            headers={"X-Access-Token": token}, timeout=TIMEOUT) as resp:
            if resp.status != 200:
                return resp.status, (await resp.text())[:200]
            return resp.status, await resp.json(content_type=None)

    return fetch


async def pull_journal(log_: EventLog, session_id: str, agent_url: str, token: str, cursor: int,
                       http: aiohttp.ClientSession | Fetch, *, page: int = PAGE) -> int:
    """Pull every journal entry after `cursor` into the session's log; returns the new cursor.

    Each page is appended in one transaction that also moves the stored cursor, compare-and-set on `cursor`: if
    another puller already moved it, nothing is appended and the stored cursor is returned.
    """
    fetch = session_fetch(http) if isinstance(http, aiohttp.ClientSession) else http
    url = agent_url.rstrip("/") + "/journal"
    for _ in range(MAX_PAGES):
        try:
            status, body = await fetch(session_id, agent_url, token, cursor, page)
        except aiohttp.ClientError as exc:
            raise JournalError(f"GET {url} failed: {exc}") from exc
        if status != 200:
            raise JournalError(f"GET {url} answered {status}: {body}")
        entries, _, oldest, last = parse_page(body, cursor)
        if not entries and last is not None and last < cursor:
            # the agent's journal ends before our cursor: it is not the journal we were reading (the agent
            # restarted, or the sandbox was replaced); say so, then read the new one from its start
            written = await log_.append_journal(session_id, cursor,
                                                [("journal.reset", {"cursor": cursor, "last": last})], 0)
            if written is None:
                return await log_.journal_cursor(session_id) or 0
            cursor = 0
            continue
        items: list[tuple[str, dict[str, Any]]] = []
        if oldest is not None and oldest > cursor + 1:
            items.append(("journal.gap", {"after": cursor, "oldest": oldest, "lost": oldest - cursor - 1}))
        items.extend((kind, data) for _, kind, data in entries)
        if not entries:
            return cursor  # a gap is recorded with the first entries that follow it
        written = await log_.append_journal(session_id, cursor, items, entries[-1][0])
        if written is None:
            return await log_.journal_cursor(session_id) or 0
        cursor = entries[-1][0]
        if len(entries) < page:
            return cursor
    return cursor


@dataclass
class _Tracked:
    agent_url: str
    token: str
    cursor: int
    lock: asyncio.Lock
    failures: int = 0
    skip: int = 0


class JournalPoller:
    """One asyncio task pulling every tracked session's journal about once a second, plus pulls on demand.

        poller = JournalPoller(event_log)
        await poller.start()
        await poller.track(sandbox_id, f"http://{ip}:{AGENT_PORT}", access_token)
        await poller.pull_now(sandbox_id)      # before a checkpoint
        async with poller.hold(sandbox_id):    # while the sandbox is frozen: no pull starts
            ...
        poller.untrack(sandbox_id)             # on pause / kill
        await poller.stop()
    """

    def __init__(self, log_: EventLog, interval: float = 1.0, http: aiohttp.ClientSession | None = None,
                 fetch: Fetch | None = None) -> None:
        self.log = log_
        self.interval = interval
        self._http = http
        self._own_http = http is None
        self.fetch = fetch
        # Whether a session's sandbox is frozen while idle (the server's idle freezer): its round skips it (a
        # frozen sandbox writes nothing; every entry was pulled before it froze).
        self.asleep: Callable[[str], bool] | None = None
        self._sessions: dict[str, _Tracked] = {}
        self._task: asyncio.Task[None] | None = None

    async def track(self, session_id: str, agent_url: str, token: str, cursor: int | None = None) -> None:
        """Start pulling a session. `cursor` (on resume or fork: the checkpoint's journal_cursor) resets where
        pulling continues; without it, it continues from the stored cursor."""
        if cursor is not None:
            await self.log.set_journal_cursor(session_id, cursor)
        else:
            cursor = await self.log.journal_cursor(session_id) or 0
        self._sessions[session_id] = _Tracked(agent_url, token, cursor, asyncio.Lock())

    def untrack(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def tracked(self) -> list[str]:
        return sorted(self._sessions)

    def cursor(self, session_id: str) -> int | None:
        """Where pulling a tracked session stands (None: not tracked; its stored cursor is the log's
        `journal_cursor`)."""
        t = self._sessions.get(session_id)
        return t.cursor if t else None

    async def pull_now(self, session_id: str) -> int:
        """Pull the session's journal now and return the cursor; raises JournalError if the agent fails."""
        t = self._sessions.get(session_id)
        if t is None:
            raise KeyError(f"session {session_id} is not tracked")
        async with t.lock:
            t.cursor = await pull_journal(self.log, session_id, t.agent_url, t.token, t.cursor,
                                          self.fetch or self._client())
            t.failures = t.skip = 0
            return t.cursor

    @contextlib.asynccontextmanager
    async def hold(self, session_id: str) -> AsyncIterator[None]:
        """No pull of the session runs inside the block: one in flight is waited for, the next waits for the
        block's end. A checkpoint is taken inside it, since a connection open in a sandbox's netstack when it
        is frozen wedges the agent after a restore."""
        t = self._sessions.get(session_id)
        if t is None:
            yield
            return
        async with t.lock:
            yield

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="keepstate-journal-poller")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._own_http and self._http is not None:
            await self._http.close()
            self._http = None

    def _client(self) -> aiohttp.ClientSession:
        if self._http is None:
            # No keep-alive: a connection left open in a sandbox's netstack when it is checkpointed
            # wedges the agent after the restore (gVisor 20240729).
            self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        return self._http

    async def poll_once(self) -> None:
        """One round over all tracked sessions; a failing agent is retried with backoff, never fatal."""
        for session_id in list(self._sessions):
            t = self._sessions.get(session_id)
            if t is None or t.lock.locked() or (self.asleep is not None and self.asleep(session_id)):
                continue
            if t.skip > 0:
                t.skip -= 1
                continue
            try:
                await self.pull_now(session_id)
            except JournalBusy:
                continue
            except (TimeoutError, JournalError, KeyError, DatabaseUnavailable) as exc:  # tried again later
                t.failures += 1
                t.skip = min(2 ** t.failures, 30)
                log.warning("journal pull for %s failed (%d in a row): %s", session_id, t.failures, exc)

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:
                log.exception("journal poller round failed")
            await asyncio.sleep(self.interval)
