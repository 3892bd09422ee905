"""The lineage: sessions, their checkpoints, and forks as children, with parent links."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from keepstate.errors import BadRequest, NotFound
from keepstate.store.manifest import EventRef

from .db import CheckpointRow, SessionDB, SessionRow

CHECKPOINT_KINDS = ("pause", "snapshot", "fork")
SESSION_STATES = ("running", "paused", "killed")
MAX_DEPTH = 1000  # parent links come from our own writes, but an import could forge a cycle


class Lineage:
    def __init__(self, path: Path | SessionDB) -> None:
        self.db = path if isinstance(path, SessionDB) else SessionDB(path)

    def close(self) -> None:
        self.db.close()

    def record_session(self, session_id: str, template_id: str | None = None, *, parent_session: str | None = None,
                       parent_checkpoint_id: str | None = None, state: str = "running",
                       created: float | None = None) -> None:
        """Record (or update the state of) a session; a fork names its parent session and checkpoint."""
        if state not in SESSION_STATES:
            raise BadRequest(f"session state must be one of {', '.join(SESSION_STATES)}, got {state!r}")
        if (parent_session is None) != (parent_checkpoint_id is None):
            raise BadRequest("a forked session names both its parent session and its parent checkpoint")
        self.db.upsert_session(SessionRow(session_id, template_id, time.time() if created is None else created,
                                          parent_session, parent_checkpoint_id, state))

    def set_state(self, session_id: str, state: str) -> None:
        if state not in SESSION_STATES:
            raise BadRequest(f"session state must be one of {', '.join(SESSION_STATES)}, got {state!r}")
        if not self.db.set_session_state(session_id, state):
            raise NotFound(f"unknown session {session_id}")

    def record_checkpoint(self, checkpoint_id: str, session_id: str, parent_checkpoint_id: str | None, kind: str,
                          event: EventRef | None, *, journal_cursor: int | None = None,
                          created: float | None = None) -> None:
        """Record a published checkpoint (its ID is the store's checkpoint ID) and the event it was taken at."""
        if kind not in CHECKPOINT_KINDS:
            raise BadRequest(f"checkpoint kind must be one of {', '.join(CHECKPOINT_KINDS)}, got {kind!r}")
        self.db.insert_checkpoint(CheckpointRow(
            checkpoint_id, session_id, parent_checkpoint_id, kind, event.seq if event else None,
            event.hash if event else None, journal_cursor, time.time() if created is None else created))

    def forget_checkpoint(self, checkpoint_id: str) -> bool:
        """Drop a checkpoint deleted from the store; forks made from it keep their parent link."""
        return self.db.delete_checkpoint(checkpoint_id)

    def session(self, session_id: str) -> SessionRow | None:
        return self.db.session(session_id)

    def spawns(self, template_id: str) -> tuple[int, float | None]:
        """How many sandboxes were created from a template (forks not counted), and when the last one was."""
        return self.db.template_spawns(template_id)

    def checkpoint(self, checkpoint_id: str) -> CheckpointRow | None:
        return self.db.checkpoint(checkpoint_id)

    def checkpoints(self, session_id: str) -> list[CheckpointRow]:
        return self.db.checkpoints_of(session_id)

    def latest_checkpoint(self, session_id: str) -> CheckpointRow | None:
        rows = self.db.checkpoints_of(session_id)
        return rows[-1] if rows else None

    def forks_of(self, checkpoint_id: str) -> list[str]:
        """IDs of the sessions forked from the checkpoint."""
        return [s.session_id for s in self.db.sessions_forked_from(checkpoint_id)]

    def root(self, session_id: str) -> str:
        row = self.db.session(session_id)
        if row is None:
            raise NotFound(f"unknown session {session_id}")
        for _ in range(MAX_DEPTH):
            if row.parent_session is None:
                return row.session_id
            parent = self.db.session(row.parent_session)
            if parent is None:
                return row.session_id  # the parent lives on another server (an imported checkpoint)
            row = parent
        raise BadRequest(f"session {session_id}: lineage deeper than {MAX_DEPTH} or cyclic")

    def tree(self, session_id: str) -> dict[str, Any]:
        """The whole lineage tree reachable from the root of `session_id`'s lineage.

        Each session node lists its checkpoints; each checkpoint lists the sessions forked from it (as nested
        session nodes). Forks whose parent checkpoint is not recorded here are listed in the session's `forks`.
        """
        root = self.root(session_id)
        return {"sessionId": session_id, "rootSessionId": root, "root": self._node(root, set())}

    def _node(self, session_id: str, seen: set[str]) -> dict[str, Any]:
        seen.add(session_id)
        row = self.db.session(session_id)
        assert row is not None
        children = [c for c in self.db.child_sessions(session_id) if c.session_id not in seen]
        checkpoints = self.db.checkpoints_of(session_id)
        known = {c.checkpoint_id for c in checkpoints}
        out_cps = []
        for cp in checkpoints:
            forks = [self._node(c.session_id, seen) for c in children if c.parent_checkpoint_id == cp.checkpoint_id]
            out_cps.append({
                "checkpointId": cp.checkpoint_id, "parentCheckpointId": cp.parent_checkpoint_id, "kind": cp.kind,
                "event": {"seq": cp.event_seq, "hash": cp.event_hash} if cp.event_seq is not None else None,
                "created": cp.created, "forks": forks})
        return {
            "sessionId": row.session_id, "templateId": row.template_id, "state": row.state, "created": row.created,
            "parentSessionId": row.parent_session, "parentCheckpointId": row.parent_checkpoint_id,
            "checkpoints": out_cps,
            "forks": [self._node(c.session_id, seen) for c in children if c.parent_checkpoint_id not in known],
        }
