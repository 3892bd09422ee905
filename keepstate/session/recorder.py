"""The server's side of the causal history: one call per lifecycle step, keeping log, lineage and journal in step.

The sandbox manager calls these instead of appending events itself, so the ordering rules of
docs/design/causal-history.md ("Checkpoints and the history") hold in one place. Every call is async: each is a few
awaited statements on the server's database; only `checkpoint_begin` also waits on the network (the last journal
pull before the freeze).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from keepstate.errors import NotFound
from keepstate.store.manifest import EventRef

from .event import Event
from .journal import JournalError, JournalPoller
from .lineage import Lineage
from .log import EventLog

log = logging.getLogger("keepstate.session.recorder")


class SessionRecorder:
    def __init__(self, events: EventLog, lineage: Lineage, poller: JournalPoller | None = None) -> None:
        self.events = events
        self.lineage = lineage
        self.poller = poller

    async def _track(self, session_id: str, agent_url: str | None, token: str | None, cursor: int | None) -> None:
        if self.poller is not None and agent_url and token:
            await self.poller.track(session_id, agent_url, token, cursor)

    def _untrack(self, session_id: str) -> None:
        if self.poller is not None:
            self.poller.untrack(session_id)

    async def created(self, session_id: str, template_id: str, template_digest: str, metadata: dict[str, str],
                      timeout: int, *, agent_url: str | None = None, token: str | None = None) -> Event:
        await self.lineage.record_session(session_id, template_id)
        ev = await self.events.append(session_id, "sandbox.create", {
            "template_id": template_id, "template_digest": template_digest, "metadata": metadata, "timeout": timeout})
        await self._track(session_id, agent_url, token, 0)
        return ev

    async def record(self, session_id: str, kind: str, data: dict[str, Any] | None = None) -> Event:
        """Any other event (sandbox.connect, sandbox.timeout.set, server.adopt, ...)."""
        return await self.events.append(session_id, kind, data)

    async def checkpoint_begin(self, session_id: str, checkpoint_id: str, parent_id: str | None,
                               kind: str, pull: bool = True) -> EventRef:
        """Pull the journal (unless `pull` is false: an agent known not to answer), append the `checkpoint` event;
        put the returned ref into the manifest's `event`.

        Call right before freezing the sandbox. A failed pull is logged, not raised: the entries stay in the
        agent's journal (captured by the checkpoint) and are pulled later.
        """
        cursor = await self.events.journal_cursor(session_id) or 0
        if pull and self.poller is not None and session_id in self.poller.tracked():
            try:
                cursor = await self.poller.pull_now(session_id)
            except (JournalError, TimeoutError) as exc:
                log.warning("journal pull before checkpoint %s of %s failed: %s", checkpoint_id, session_id, exc)
        ev = await self.events.append(session_id, "checkpoint", {
            "checkpoint_id": checkpoint_id, "parent_id": parent_id, "kind": kind, "journal_cursor": cursor})
        return EventRef(ev.seq, ev.hash)

    def journal_hold(self, session_id: str) -> contextlib.AbstractAsyncContextManager[None]:
        """While the sandbox is frozen for a checkpoint: no journal pull may hold a connection into it."""
        if self.poller is None:
            return contextlib.nullcontext()
        return self.poller.hold(session_id)

    async def checkpoint_published(self, session_id: str, checkpoint_id: str, parent_id: str | None, kind: str,
                                   event: EventRef) -> None:
        """The checkpoint's ref is written: record it in the lineage."""
        at = await self.events.event_at(session_id, event.seq)
        cursor = at.data.get("journal_cursor") if at is not None else None
        await self.lineage.record_checkpoint(checkpoint_id, session_id, parent_id, kind, event,
                                             journal_cursor=cursor if isinstance(cursor, int) else None)

    async def checkpoint_failed(self, session_id: str, checkpoint_id: str, error: str) -> Event:
        return await self.events.append(session_id, "checkpoint.failed",
                                        {"checkpoint_id": checkpoint_id, "error": error})

    async def paused(self, session_id: str, checkpoint_id: str, memory: bool) -> Event:
        self._untrack(session_id)
        await self.lineage.set_state(session_id, "paused")
        return await self.events.append(session_id, "sandbox.pause",
                                        {"checkpoint_id": checkpoint_id, "memory": memory})

    async def resumed(self, session_id: str, checkpoint_id: str, host: str, *, agent_url: str | None = None,
                      token: str | None = None, source: str = "store") -> Event:
        """The session runs again from `checkpoint_id` (restored from the store, or thawed from the standby frozen
        in exactly that state: source "standby"); journal pulling restarts at the checkpoint's cursor."""
        row = await self.lineage.checkpoint(checkpoint_id)
        ev = await self.events.append(session_id, "sandbox.resume",
                                      {"checkpoint_id": checkpoint_id, "host": host, "from": source})
        await self.lineage.set_state(session_id, "running")
        cursor = row.journal_cursor if row is not None and row.journal_cursor is not None else None
        if cursor is not None:
            await self.events.set_journal_cursor(session_id, cursor)
        await self._track(session_id, agent_url, token, cursor)
        return ev

    async def forked(self, parent_session: str, child_session: str, checkpoint_id: str, *,
                     agent_url: str | None = None, token: str | None = None) -> Event:
        """A new session restored from the parent's checkpoint; returns the child's `session.fork` event."""
        row = await self.lineage.checkpoint(checkpoint_id)
        if row is None and await self.lineage.session(parent_session) is None:
            # A checkpoint from the shared store whose session this server never ran (a template built, or a
            # snapshot taken, on another server): its history is in that server's session DB, so the child's
            # begins here with a link by ID, not by event hash.
            await self.lineage.record_session(child_session, None, parent_session=parent_session,
                                              parent_checkpoint_id=checkpoint_id)
            first = await self.events.append(child_session, "session.fork.remote", {
                "parent_session": parent_session, "checkpoint_id": checkpoint_id,
                "note": "the parent's history is on the server that made the checkpoint"})
            await self._track(child_session, agent_url, token, None)
            return first
        if row is None or row.event_seq is None or row.event_hash is None:
            raise NotFound(f"checkpoint {checkpoint_id} is not in the lineage (or has no event); record it first")
        parent = await self.lineage.session(parent_session)
        first = await self.events.start_fork(child_session, parent_session, checkpoint_id,
                                             EventRef(row.event_seq, row.event_hash))
        await self.lineage.record_session(child_session, parent.template_id if parent else None,
                                          parent_session=parent_session, parent_checkpoint_id=checkpoint_id)
        await self._track(child_session, agent_url, token, row.journal_cursor)
        return first

    async def killed(self, session_id: str, reason: str) -> Event:
        self._untrack(session_id)
        ev = await self.events.append(session_id, "sandbox.kill", {"reason": reason})
        if await self.lineage.session(session_id) is not None:
            await self.lineage.set_state(session_id, "killed")
        return ev
