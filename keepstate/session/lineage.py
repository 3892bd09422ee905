"""The lineage: sessions, their checkpoints, and forks as children, with parent links."""

from __future__ import annotations

import time
from typing import Any

from keepstate.db.engine import Database
from keepstate.db.records import CheckpointRecord, SessionRecord
from keepstate.db.repos.history import History
from keepstate.errors import BadRequest, NotFound
from keepstate.store.manifest import EventRef

CHECKPOINT_KINDS = ("pause", "snapshot", "fork", "policy")  # policy: a checkpoint policy's (cluster.md)
SESSION_STATES = ("running", "paused", "killed")
MAX_DEPTH = 1000  # parent links come from our own writes, but an import could forge a cycle


# A session's row and a checkpoint's, as the history stores them (keepstate.db.records): the names the session
# package has always exported.
SessionRow = SessionRecord
CheckpointRow = CheckpointRecord


class Lineage:
    """Sessions and their checkpoints in the server's one database (keepstate.db.repos.History); async."""

    def __init__(self, db: Database | History) -> None:
        self.history = db if isinstance(db, History) else History(db)

    async def record_session(self, session_id: str, template_id: str | None = None, *,
                             parent_session: str | None = None, parent_checkpoint_id: str | None = None,
                             state: str = "running", created: float | None = None) -> None:
        """Record (or update the state of) a session; a fork names its parent session and checkpoint."""
        if state not in SESSION_STATES:
            raise BadRequest(f"session state must be one of {', '.join(SESSION_STATES)}, got {state!r}")
        if (parent_session is None) != (parent_checkpoint_id is None):
            raise BadRequest("a forked session names both its parent session and its parent checkpoint")
        await self.history.put_session(SessionRecord(
            session_id=session_id, template_id=template_id, created=time.time() if created is None else created,
            parent_session=parent_session, parent_checkpoint_id=parent_checkpoint_id, state=state))

    async def set_state(self, session_id: str, state: str) -> None:
        if state not in SESSION_STATES:
            raise BadRequest(f"session state must be one of {', '.join(SESSION_STATES)}, got {state!r}")
        if not await self.history.set_session_state(session_id, state):
            raise NotFound(f"unknown session {session_id}")

    async def record_checkpoint(self, checkpoint_id: str, session_id: str, parent_checkpoint_id: str | None,
                                kind: str, event: EventRef | None, *, journal_cursor: int | None = None,
                                created: float | None = None) -> None:
        """Record a published checkpoint (its ID is the store's checkpoint ID) and the event it was taken at."""
        if kind not in CHECKPOINT_KINDS:
            raise BadRequest(f"checkpoint kind must be one of {', '.join(CHECKPOINT_KINDS)}, got {kind!r}")
        await self.history.put_checkpoint(CheckpointRecord(
            checkpoint_id=checkpoint_id, session_id=session_id, parent_checkpoint_id=parent_checkpoint_id, kind=kind,
            event_seq=event.seq if event else None, event_hash=event.hash if event else None,
            journal_cursor=journal_cursor, created=time.time() if created is None else created))

    async def forget_checkpoint(self, checkpoint_id: str) -> bool:
        """Drop a checkpoint deleted from the store; forks made from it keep their parent link."""
        return await self.history.delete_checkpoint(checkpoint_id)

    async def session(self, session_id: str) -> SessionRow | None:
        rec = await self.history.session(session_id)
        return rec if rec is not None else None

    async def spawns(self, template_id: str) -> tuple[int, float | None]:
        """How many sandboxes were created from a template (forks not counted), and when the last one was."""
        return await self.history.template_spawns(template_id)

    async def checkpoint(self, checkpoint_id: str) -> CheckpointRow | None:
        rec = await self.history.checkpoint(checkpoint_id)
        return rec if rec is not None else None

    async def checkpoints(self, session_id: str) -> list[CheckpointRow]:
        return await self.history.checkpoints_of(session_id)

    async def latest_checkpoint(self, session_id: str) -> CheckpointRow | None:
        rows = await self.checkpoints(session_id)
        return rows[-1] if rows else None

    async def forks_of(self, checkpoint_id: str) -> list[str]:
        """IDs of the sessions forked from the checkpoint."""
        return [s.session_id for s in await self.history.sessions_forked_from(checkpoint_id)]

    async def root(self, session_id: str) -> str:
        row = await self.session(session_id)
        if row is None:
            raise NotFound(f"unknown session {session_id}")
        for _ in range(MAX_DEPTH):
            if row.parent_session is None:
                return row.session_id
            parent = await self.session(row.parent_session)
            if parent is None:
                return row.session_id  # the parent lives on another server (an imported checkpoint)
            row = parent
        raise BadRequest(f"session {session_id}: lineage deeper than {MAX_DEPTH} or cyclic")

    async def tree(self, session_id: str) -> dict[str, Any]:
        """The whole lineage tree reachable from the root of `session_id`'s lineage.

        Each session node lists its checkpoints; each checkpoint lists the sessions forked from it (as nested
        session nodes). Forks whose parent checkpoint is not recorded here are listed in the session's `forks`.
        """
        root = await self.root(session_id)
        return {"sessionId": session_id, "rootSessionId": root, "root": await self._node(root, set())}

    async def _node(self, session_id: str, seen: set[str]) -> dict[str, Any]:
        seen.add(session_id)
        row = await self.session(session_id)
        assert row is not None
        children = [c for c in await self.history.child_sessions(session_id) if c.session_id not in seen]
        checkpoints = await self.checkpoints(session_id)
        known = {c.checkpoint_id for c in checkpoints}
        out_cps = []
        for cp in checkpoints:
            forks = [await self._node(c.session_id, seen) for c in children
                     if c.parent_checkpoint_id == cp.checkpoint_id]
            out_cps.append({
                "checkpointId": cp.checkpoint_id, "parentCheckpointId": cp.parent_checkpoint_id, "kind": cp.kind,
                "event": {"seq": cp.event_seq, "hash": cp.event_hash} if cp.event_seq is not None else None,
                "created": cp.created, "forks": forks})
        return {
            "sessionId": row.session_id, "templateId": row.template_id, "state": row.state, "created": row.created,
            "parentSessionId": row.parent_session, "parentCheckpointId": row.parent_checkpoint_id,
            "checkpoints": out_cps,
            "forks": [await self._node(c.session_id, seen) for c in children if c.parent_checkpoint_id not in known],
        }
