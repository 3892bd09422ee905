"""A fenced node holds its sandboxes still (docs/design/cluster.md, "Fencing").

A node that cannot renew its lease fences itself before the database would call it dead (cluster/membership.py):
from then on it answers nothing for its sandboxes, and here its sandboxes stop too, so that none of them acts while
another node may be taking it over:

- `hold()`: every instance of this host is frozen (the runtime's idle freeze: no CPU, memory kept) and its egress
  cut (its slot's rules and proxy binding removed), so it neither computes nor reaches anything;
- `release()`: the same incarnation renewed after all (nothing was taken from it): each is thawed and its egress
  given back;
- `reconcile()`: the incarnation was declared dead or removed: each sandbox whose row another node (or a later
  epoch) holds now, or that has no row any more, is destroyed here without a write; the rest are still this node's
  and run on once it has joined again.

The database's own guard stands behind this: every write of a row, and every append to a session's history, is
conditioned on the epoch this node holds it at (db/repos/sandboxes.py, db/repos/history.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from keepstate.runtime.base import RuntimeFailure

from .instances import handle_of
from .state import State

if TYPE_CHECKING:
    from .manager import SandboxManager
    from .record import SandboxRow

log = logging.getLogger("keepstate.sandbox.fencing")

HELD_STATES = (State.POOLED, State.RUNNING, State.CHECKPOINTING, State.PAUSING, State.RESUMING)


class FenceHold:
    def __init__(self, m: SandboxManager) -> None:
        self.m = m
        self.held: dict[str, SandboxRow] = {}  # sandbox -> the row whose instance this froze
        self._lock = asyncio.Lock()

    def _instances(self) -> list[SandboxRow]:
        m = self.m
        rows = [r for r in m.table.all() if r.state in HELD_STATES and r.runtime_name]
        return rows + [r for pool in m.pools.values() for r in pool.ready() if r.runtime_name]

    async def hold(self) -> None:
        async with self._lock:
            for row in self._instances():
                sid = row.sandbox_id
                if sid in self.held:
                    continue
                try:
                    if not self.m.idle.frozen(sid):
                        await asyncio.to_thread(self.m.runtime.idle_freeze, handle_of(row))
                    await self.m.instances.close_egress(row.slot)
                except (RuntimeFailure, OSError) as exc:
                    log.error("fenced: holding sandbox %s failed: %s", sid, exc)
                self.held[sid] = row
            log.warning("fenced: %d sandboxes held still (frozen, egress cut)", len(self.held))

    async def release(self) -> None:
        async with self._lock:
            held, self.held = self.held, {}
            for sid, row in held.items():
                try:
                    if not self.m.idle.frozen(sid):
                        await asyncio.to_thread(self.m.runtime.idle_thaw, handle_of(row))
                    if row.state != State.POOLED:  # a pooled one sends nothing until a create claims it
                        await self.m.instances.attach(row)
                except (RuntimeFailure, OSError) as exc:
                    log.error("unfenced: releasing sandbox %s failed: %s", sid, exc)
            if held:
                log.warning("unfenced: %d sandboxes run again", len(held))

    async def reconcile(self) -> list[str]:
        """Destroy what this node no longer owns (its incarnation was declared dead or removed); the IDs."""
        m = self.m
        gone: list[str] = []
        for row in list(m.table.all()):
            sid = row.sandbox_id
            seen = m.rows.seen(sid)
            holder = await m.rows.holder(sid)
            if holder is not None and seen is not None and holder == (m.rows.node_id, seen[1]):
                continue
            log.warning("sandbox %s is %s now: destroying this node's instance of it", sid,
                        f"node {holder[0]}'s at epoch {holder[1]}" if holder is not None else "gone")
            m.table.forget(sid)
            m.rows.forget(sid)
            self.held.pop(sid, None)
            m.idle.forget(sid)
            if m.recorder.poller is not None:
                m.recorder.poller.untrack(row.session_id)
            m.standbys.discard(sid)
            # Its row is not this node's to delete (keep_row): only the instances on this host go.
            for instance in (row, *(row.with_instance(i) for i in (row.settings.standby, row.settings.retired)
                                    if i is not None)):
                if instance.runtime_name:
                    await m.instances.reap(instance, keep_row=True)
            gone.append(sid)
        return gone
