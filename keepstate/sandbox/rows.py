"""The sandbox package's view of the database: its rows, snapshots and teardowns as the package's own types.

`SandboxRows` turns `SandboxRow`s into the records of keepstate.db and back, and conditions every write of a row on
the version it was last read or written at (docs/design/database.md, "Concurrency rules"): a row that another
writer changed meanwhile is `Stale`, never silently overwritten. The versions are kept here, not on `SandboxRow`,
which the package copies freely (`with_instance`).

    rows = SandboxRows(db, node_id="local")
    await rows.put(row)              # insert, or a conditional update of the version last seen
    for row in await rows.list(): ...
"""

from __future__ import annotations

import builtins
import json
import time
from dataclasses import replace
from typing import Any

from keepstate.db.engine import Database
from keepstate.db.errors import Fenced, Stale
from keepstate.db.records import SandboxRecord, SnapshotRecord
from keepstate.db.repos import Sandboxes, Snapshots
from keepstate.db.setup import LOCAL_NODE
from keepstate.errors import Conflict, NotFound

from .record import SandboxRow, Settings, Snapshot, TeardownRecord
from .state import State

# A gone node's rows in these states had an instance there: taken over from their latest checkpoint, or lost.
LOST_STATES = ("running", "checkpointing", "pausing")

class SandboxRows:
    def __init__(self, db: Database, node_id: str = LOCAL_NODE) -> None:
        self.db = db
        self.node_id = node_id
        self._repo = Sandboxes(db)
        self._snapshots = Snapshots(db)
        self._seen: dict[str, tuple[int, int]] = {}  # sandbox ID -> (version, epoch) last read or written

    # -- rows --------------------------------------------------------------------------------------------------------
    async def put(self, row: SandboxRow) -> None:
        """Write the row: a new one is inserted; a known one is updated only if it is still at the version this
        process last saw (Stale or Fenced otherwise, keepstate.db.errors)."""
        seen = self._seen.get(row.sandbox_id)
        if seen is None:
            try:
                await self._repo.insert(self._record(row))
                self._seen[row.sandbox_id] = (0, 0)
                return
            except Conflict:  # written by this node before this process knew it (a pooled row, adoption)
                found = await self._repo.get(row.sandbox_id)
                if found is None:
                    raise
                if found.node_id != self.node_id:  # never another node's: that is a take-over (take_over)
                    raise Conflict(f"sandbox {row.sandbox_id} belongs to node {found.node_id}") from None
                seen = (found.version, found.epoch)
        changes = self._columns(row)
        version = await self._repo.transition(row.sandbox_id, seen[0], seen[1], **changes)
        self._seen[row.sandbox_id] = (version, seen[1])

    async def others(self, states: tuple[State, ...]) -> builtins.list[SandboxRow]:
        """Other nodes' sandboxes in `states`, as rows to show (not to write: their versions are not remembered)."""
        return [self._view(rec) for rec in await self._repo.others(self.node_id, [str(s) for s in states])]

    async def owner(self, sandbox_id: str) -> str | None:
        """The node whose row the sandbox is (None: no row)."""
        found = await self._repo.get(sandbox_id)
        return found.node_id if found is not None else None

    async def take_over(self, sandbox_id: str) -> tuple[SandboxRow, SandboxRow | None] | None:
        """A sandbox of a node that is gone, now this node's and paused (its epoch moved on): (row, None) for one
        that was paused there; (row, the row as it was) for one that was running there, paused now at its latest
        checkpoint (the work since is lost: docs/design/cluster.md, "Loss of a node"). None if not possible: no such
        row, its node is live, or it was running with no checkpoint to resume from."""
        rec = await self._repo.take_over(sandbox_id, self.node_id)
        if rec is not None:
            return self._row(rec), None
        found = await self._repo.get(sandbox_id)
        if found is None or found.state not in LOST_STATES:
            return None
        was = self._view(found)
        if was.settings.checkpoint_id is None:
            return None
        rec = await self._repo.take_over(sandbox_id, self.node_id, LOST_STATES, expect_version=found.version)
        return (self._row(rec), was) if rec is not None else None

    async def hand_over(self, row: SandboxRow, to_node: str, resume: bool = False) -> None:
        """Give this node's paused sandbox to the live node `to_node` (its epoch moves on): not this node's after.
        `resume`: `to_node` resumes it at once (`handed`)."""
        seen = self._seen.get(row.sandbox_id)
        if seen is None:
            raise Conflict(f"sandbox {row.sandbox_id} is not one this node has read")
        await self._repo.hand_over(row.sandbox_id, to_node, seen[0], seen[1], doc=json.dumps(row.settings.to_json()),
                                   resume_pending=resume)
        self._seen.pop(row.sandbox_id, None)

    async def handed(self) -> builtins.list[SandboxRow]:
        """This node's paused sandboxes handed to it to resume at once."""
        return [self._view(rec) for rec in await self._repo.handed(self.node_id)]

    async def take_handed(self, sandbox_id: str) -> bool:
        """Claim a handed sandbox's resume (one round of one node does it); False if it was claimed already."""
        self._seen.pop(sandbox_id, None)  # its version moves: read again when it is loaded
        return await self._repo.take_handed(sandbox_id, self.node_id)

    async def on_gone_nodes(self, limit: int = 100) -> builtins.list[tuple[SandboxRow, str, int, int]]:
        """Sandboxes that were running (or on their way) on a node that is gone, with (that node, the row's version,
        its epoch): to take over, or to declare lost."""
        return [(self._view(rec), rec.node_id, rec.version, rec.epoch)
                for rec in await self._repo.on_gone_nodes(LOST_STATES, limit)]

    async def delete_lost(self, sandbox_id: str, version: int, epoch: int) -> bool:
        """Delete a gone node's row as it was read (`version`, `epoch`); False if it changed meanwhile."""
        try:
            await self._repo.delete(sandbox_id, expect_version=version, expect_epoch=epoch)
        except (Stale, Fenced, NotFound):
            return False
        return True

    async def peek(self, sandbox_id: str) -> tuple[str, SandboxRow] | None:
        """(its node, the row) as stored, to look at (not to write: its version is not remembered); None: no row."""
        found = await self._repo.get(sandbox_id)
        return (found.node_id, self._view(found)) if found is not None else None

    async def holder(self, sandbox_id: str) -> tuple[str, int] | None:
        """(node, epoch) of the sandbox's row now (None: no row)."""
        found = await self._repo.get(sandbox_id)
        return (found.node_id, found.epoch) if found is not None else None

    def seen(self, sandbox_id: str) -> tuple[int, int] | None:
        """(version, epoch) this process last read or wrote the row at."""
        return self._seen.get(sandbox_id)

    def forget(self, sandbox_id: str) -> None:
        self._seen.pop(sandbox_id, None)

    async def claim(self, pooled_id: str, row: SandboxRow) -> None:
        """Replace the pooled row `pooled_id` by `row` (a user's ID) in one transaction."""
        await self._repo.claim_pooled(pooled_id, self._record(row))
        self._seen.pop(pooled_id, None)
        self._seen[row.sandbox_id] = (0, 0)

    async def delete(self, sandbox_id: str, teardown: TeardownRecord | None = None) -> None:
        """Forget the row, recording `teardown` in the same transaction when given."""
        await self._repo.delete(sandbox_id, replace(teardown, node_id=self.node_id) if teardown is not None else None)
        self._seen.pop(sandbox_id, None)

    async def get(self, sandbox_id: str) -> SandboxRow | None:
        found = await self._repo.get(sandbox_id)
        return self._row(found) if found is not None else None

    async def list(self, states: tuple[State, ...] | None = None) -> builtins.list[SandboxRow]:
        """This node's rows (in `states`, if given)."""
        wanted = [str(s) for s in states] if states else None
        return [self._row(r) for r in await self._repo.list(self.node_id, wanted)]

    async def used_slots(self) -> set[int]:
        return await self._repo.used_slots(self.node_id)

    # -- teardowns ---------------------------------------------------------------------------------------------------
    async def add_teardown(self, runtime_name: str, slot: int) -> None:
        """Record a teardown to do; one already recorded for the instance keeps its attempts."""
        await self._repo.add_teardown(TeardownRecord(runtime_name=runtime_name, slot=slot, next_try=time.time(),
                                                     node_id=self.node_id))

    async def teardown_failed(self, runtime_name: str, next_try: float, error: str) -> None:
        await self._repo.teardown_failed(runtime_name, error, next_try)

    async def delete_teardown(self, runtime_name: str) -> None:
        await self._repo.delete_teardown(runtime_name)

    async def teardowns(self) -> builtins.list[TeardownRecord]:
        return await self._repo.teardowns(self.node_id)

    # -- snapshots (checkpoints usable as a templateID) ------------------------------------------------------------
    async def put_snapshot(self, snapshot_id: str, names: builtins.list[str], checkpoint_id: str, sandbox_id: str,
                           template_id: str) -> None:
        await self._snapshots.put(SnapshotRecord(snapshot_id=snapshot_id, checkpoint_id=checkpoint_id,
                                                 sandbox_id=sandbox_id, template_id=template_id,
                                                 created_at=time.time(), names=tuple(names)))

    async def find_snapshot(self, ref: str) -> Snapshot | None:
        """A snapshot by ID, by name, or by a name:tag's name."""
        found = await self._snapshots.get(ref) or await self._snapshots.by_name(ref)
        if found is None and ":" in ref:
            found = await self._snapshots.by_name(ref.split(":")[0])
        return snapshot_of(found) if found is not None else None

    async def snapshots(self) -> builtins.list[Snapshot]:
        return [snapshot_of(s) for s in await self._snapshots.list()]

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        return await self._snapshots.delete(snapshot_id)

    # -- conversions -------------------------------------------------------------------------------------------------
    def _columns(self, row: SandboxRow) -> dict[str, Any]:
        return {"state": str(row.state), "template_id": row.template_id, "template_digest": row.template_digest,
                "runtime_name": row.runtime_name, "slot": row.slot, "address": row.address,
                "access_token": row.access_token, "started_at": row.started_at, "end_at": row.end_at,
                "cpu": row.cpu, "memory_mb": row.memory_mb, "api_key_id": row.api_key_id,
                "doc": json.dumps(row.settings.to_json()), "node_id": self.node_id}

    def _record(self, row: SandboxRow) -> SandboxRecord:
        return SandboxRecord(sandbox_id=row.sandbox_id, **self._columns(row))

    def _row(self, rec: SandboxRecord) -> SandboxRow:
        self._seen[rec.sandbox_id] = (rec.version, rec.epoch)
        return self._view(rec)

    def _view(self, rec: SandboxRecord) -> SandboxRow:
        return SandboxRow(sandbox_id=rec.sandbox_id, state=State(rec.state), template_id=rec.template_id,
                          template_digest=rec.template_digest, runtime_name=rec.runtime_name, slot=rec.slot,
                          address=rec.address, access_token=rec.access_token, started_at=rec.started_at,
                          end_at=rec.end_at, cpu=rec.cpu, memory_mb=rec.memory_mb, api_key_id=rec.api_key_id,
                          settings=Settings.from_json(json.loads(rec.doc)))


def snapshot_of(s: SnapshotRecord) -> Snapshot:
    return Snapshot(snapshot_id=s.snapshot_id, checkpoint_id=s.checkpoint_id, sandbox_id=s.sandbox_id,
                    template_id=s.template_id, names=tuple(s.names), created_at=s.created_at)
