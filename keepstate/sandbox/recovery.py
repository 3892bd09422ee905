"""Sessions that outlive their node (docs/design/cluster.md, "Loss of a node"): the checkpoint policy, and the
take-over of a gone node's sandboxes.

- **Checkpoint policy.** A running sandbox is checkpointed every N seconds (its create's `checkpointEvery`, else the
  server's `--checkpoint-every`; 0: never), incrementally (the store keeps only chunks it lacks). A sandbox frozen
  while idle that nothing reached since its last checkpoint is skipped: nothing in it can have changed.
- **Take-over.** A sandbox whose node is gone (left, declared dead, removed) is taken by the node that touches it
  first, in one conditional update that moves its epoch on (`SandboxRows.take_over`): a paused one as it was; a
  running one from its latest checkpoint, the work since lost, and said so in its history (`sandbox.node.lost`:
  the node, the last event recorded there, the checkpoint resumed from and the window lost). A connect or resume
  takes one over on demand; `adopt_lost` runs on every node of a cluster and resumes a gone node's running sandboxes
  (each node takes its share: the conditional update gives each to one). One that was running with no checkpoint
  cannot come back: its row goes, and its history says `sandbox.lost`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from keepstate.cluster.placement import incompatible, ranked
from keepstate.db.errors import DatabaseUnavailable
from keepstate.db.repos import Nodes
from keepstate.db.repos.placement import Placement
from keepstate.errors import Conflict, KeepStateError, NotFound, Unavailable

from .rows import LOST_STATES
from .state import State

if TYPE_CHECKING:
    from keepstate.db.records import NodeRecord

    from .manager import SandboxManager
    from .record import SandboxRow

log = logging.getLogger("keepstate.sandbox.recovery")

POLICY_INTERVAL = 1.0  # how often the checkpoint policy looks at the running sandboxes
MIN_RESUME_TIMEOUT = 60  # a lost sandbox resumed elsewhere runs at least this long (its own timeout if longer)


async def known(m: SandboxManager, sandbox_id: str) -> None:
    """Load a sandbox unknown here: one of a node that is gone (taken over), or one whose pause checkpoint is in the
    (shared) store and that no database row names; NotFound if neither."""
    if sandbox_id in m.table:
        return
    async with m.table.lock(sandbox_id):
        if sandbox_id in m.table:
            return
        owner = await m.rows.owner(sandbox_id)
        if owner is not None and owner != m.rows.node_id:
            await take_over(m, sandbox_id, owner)
            return
        if owner == m.rows.node_id and await _enter_own(m, sandbox_id):
            return
        row = await asyncio.to_thread(m.checkpoints.paused_row, sandbox_id)
        if row is None:
            raise NotFound(f"sandbox \"{sandbox_id}\" not found")
        session = await m.recorder.lineage.session(row.session_id)
        if session is not None and session.state == "killed":  # the database is the authority: a kill sticks
            raise NotFound(f"sandbox \"{sandbox_id}\" not found")
        await m.rows.put(row)
        m.table.enter(row)
        if await m.recorder.lineage.session(row.session_id) is None:  # this server's history lacks it
            await m.recorder.lineage.record_session(row.session_id, row.template_id)


async def _enter_own(m: SandboxManager, sandbox_id: str) -> bool:
    """Enter a paused row of this node's that the table does not know (a draining or stopping node handed it over:
    hand_over_paused); False if the row is not that. Under the sandbox's lock."""
    row = await m.rows.get(sandbox_id)
    if row is None or row.state != State.PAUSED:
        return False
    row.runtime_name, row.slot, row.address = "", -1, ""
    row.settings.standby = row.settings.retired = None  # the other host's
    m.table.enter(row)
    return True


async def load_own(m: SandboxManager, sandbox_id: str) -> bool:
    """Whether this node holds the sandbox, loading it first if its row is this node's but the table does not know
    it (a draining node handed it over: hand_over_paused)."""
    if sandbox_id in m.table:
        return True
    try:
        if await m.rows.owner(sandbox_id) == m.rows.node_id:
            async with m.table.lock(sandbox_id):
                if sandbox_id not in m.table:
                    await _enter_own(m, sandbox_id)
    except (KeepStateError, DatabaseUnavailable) as exc:
        log.info("loading sandbox %s from its row: %s", sandbox_id, exc)
    return sandbox_id in m.table


async def compatible(m: SandboxManager, origin: str) -> NodeRecord | None:
    """Node `origin`'s record (None: it never joined); Unavailable (`sandbox_no_compatible_node`) if this node
    cannot resume a checkpoint taken on it."""
    nodes = Nodes(m.db)
    theirs, mine = await nodes.get(origin), await nodes.get(m.rows.node_id)
    why = incompatible(mine, theirs) if theirs is not None and mine is not None else None
    if why is not None:
        raise Unavailable(f"this node cannot resume the sandbox: {why}; send the request to a compatible node",
                          error_code="sandbox_no_compatible_node")
    return theirs


def resume_timeout(end_at: float) -> int:
    """The timeout a sandbox resumed by this node unasked runs with: what its own had left, MIN_RESUME_TIMEOUT at
    least."""
    return max(MIN_RESUME_TIMEOUT, int(end_at - time.time()))


async def take_over(m: SandboxManager, sandbox_id: str, owner: str) -> None:
    """Make a gone node's sandbox this node's, paused at its latest checkpoint (under the sandbox's lock)."""
    origin = await compatible(m, owner)
    moved = await m.rows.take_over(sandbox_id)
    if moved is None:
        raise Conflict(f"sandbox {sandbox_id} is on node {owner}, which is live (or the sandbox is neither paused "
                       "nor running with a checkpoint to resume from): send its requests to that node")
    row, was = moved
    row.runtime_name, row.slot, row.address = "", -1, ""
    row.settings.standby = row.settings.retired = None  # the gone node's host's: its next start reaps them
    m.table.enter(row)  # this node's now, in the database: held here whatever follows (a kill works)
    if row.settings.checkpoint_id is None:
        raise Conflict(f"sandbox {sandbox_id} of node {owner} has no checkpoint to resume from")
    if was is not None:
        await m.recorder.record(row.session_id, "sandbox.node.lost", await _loss(m, row, was, owner, origin))
        log.warning("took over running sandbox %s from node %s, which is gone: it resumes from checkpoint %s",
                    sandbox_id, owner, row.settings.checkpoint_id)
    else:
        log.warning("took over paused sandbox %s from node %s, which is gone", sandbox_id, owner)
    await m.recorder.record(row.session_id, "sandbox.node.moved",
                            {"from": owner, "to": m.rows.node_id, "checkpoint": row.settings.checkpoint_id})


async def _loss(m: SandboxManager, row: SandboxRow, was: SandboxRow, owner: str,
                node: NodeRecord | None) -> dict[str, object]:
    """What a running sandbox lost with its node (`node`, its record): the window from its checkpoint to the node's
    end."""
    last = await m.recorder.events.head(row.session_id)
    ended = node.lease_expires_at if node is not None else time.time()
    at = was.settings.checkpoint_at
    return {"node": owner, "nodeState": node.state if node is not None else "unknown", "state": str(was.state),
            "checkpoint": row.settings.checkpoint_id, "checkpointAt": at or None, "nodeLeaseEndedAt": ended,
            "lostSeconds": round(max(0.0, ended - at), 3) if at else None,
            "lastEvent": {"seq": last.seq, "kind": last.kind, "ts": last.ts} if last is not None else None}


async def on_request(m: SandboxManager, sandbox_id: str) -> None:
    """A request on the data plane (a port URL, the agent's API) for a sandbox that no live node holds: one handed to
    this node is loaded; one of a gone node is taken over here, and resumed at once if it was running there (its
    latest checkpoint); a paused one is this node's now, and its traffic is answered as for any paused sandbox
    (autoResume wakes it)."""
    if sandbox_id in m.table:
        return
    try:
        found = await m.rows.peek(sandbox_id)
        if found is None:
            return
        node, row = found
        if node == m.rows.node_id:  # handed to this node: loaded
            await load_own(m, sandbox_id)
        elif row.state in LOST_STATES:
            await m.connect(sandbox_id, resume_timeout(row.end_at))
        elif row.state == State.PAUSED:
            await known(m, sandbox_id)
    except (KeepStateError, DatabaseUnavailable) as exc:  # a live node holds it, or it cannot move: answered as is
        log.info("a request for sandbox %s did not take it over: %s", sandbox_id, exc)


async def adopt_lost(m: SandboxManager) -> list[str]:
    """One round on a node of a cluster: resume this node's share of the running sandboxes of gone nodes (their
    latest checkpoint), and declare lost those that have none. The sandboxes resumed here."""
    try:
        found = await m.rows.on_gone_nodes()
        if not found:
            return []
        live = sum(1 for node in await Nodes(m.db).list() if node.state == "alive")
    except DatabaseUnavailable:
        return []
    resumed: list[str] = []
    share = math.ceil(len(found) / max(1, live))
    for row, owner, version, epoch in found:
        if row.settings.checkpoint_id is None:
            if await m.rows.delete_lost(row.sandbox_id, version, epoch):
                log.error("sandbox %s was running on node %s, which is gone, and has no checkpoint: it is lost",
                          row.sandbox_id, owner)
                await m.recorder.record(row.session_id, "sandbox.lost",
                                        {"node": owner, "reason": "its node is gone and it had no checkpoint"})
            continue
        if len(resumed) >= share or not m.places.room():
            continue
        try:
            await m.connect(row.sandbox_id, resume_timeout(row.end_at))
        except KeepStateError as exc:  # another node took it first, it cannot be resumed here (a compatible node
            log.info("taking over sandbox %s of node %s: %s", row.sandbox_id, owner, exc)  # takes it), or it failed
            continue
        resumed.append(row.sandbox_id)
    return resumed


async def lost_loop(m: SandboxManager, interval: float, serving: Callable[[], bool],
                    draining: Callable[[], bool] = lambda: False) -> None:
    """Every `interval` seconds: `adopt_lost` while this node serves (alive, not fenced), `hand_over_paused` while it
    drains."""
    while True:
        await asyncio.sleep(interval)
        try:
            if serving():
                await adopt_lost(m)
                await adopt_handed(m)
            elif draining():
                await hand_over_paused(m)
        except Exception:  # never let the loop die: the next round tries again
            log.exception("taking over the sandboxes of gone nodes, or handing paused ones over")


async def hand_over_paused(m: SandboxManager, resume: frozenset[str] = frozenset()) -> list[str]:
    """A draining (or stopping) node's paused sandboxes go to the other live nodes: each standby released (its
    checkpoint is in the shared store), then each row handed to a node placement ranks first (round robin over
    them), its epoch moved on; the new owner loads it at its next request, or at once for those in `resume`
    (`--on-stop handover`: they were running). The sandboxes handed over."""
    for sid in m.standbys.ids():
        await m.release_standby(sid, "the node drains")
    try:
        loads = await Placement(m.db).loads()
    except DatabaseUnavailable:
        return []
    targets = [n for n in ranked(loads, 0.0, 0, None, k=len(loads)) if n.node_id != m.rows.node_id]
    moved: list[str] = []
    for row in [r for r in m.table.all() if r.state == State.PAUSED]:
        if not targets:
            break
        sid = row.sandbox_id
        async with m.table.amend(sid) as held:
            if held is None or held.state != State.PAUSED or held.settings.standby is not None:
                continue
            target = targets[len(moved) % len(targets)]
            given = held.copy()
            given.settings.standby = given.settings.retired = None  # this host's: its teardowns are this node's
            try:
                await m.rows.hand_over(given, target.node_id, resume=sid in resume)
            except (KeepStateError, DatabaseUnavailable) as exc:  # changed meanwhile, or the target left: next round
                log.info("handing paused sandbox %s over to node %s: %s", sid, target.node_id, exc)
                continue
            m.table.forget(sid)
            m.idle.forget(sid)
        moved.append(sid)
        log.info("paused sandbox %s handed over to node %s (this node drains or stops)", sid, target.node_id)
        await m.recorder.record(row.session_id, "sandbox.node.moved", {
            "from": m.rows.node_id, "to": target.node_id, "checkpoint": row.settings.checkpoint_id,
            "reason": "handover" if sid in resume else "drain"})
    return moved


async def adopt_handed(m: SandboxManager) -> list[str]:
    """Resume the sandboxes a stopping node handed to this one to run at once; the IDs resumed."""
    try:
        handed = await m.rows.handed()
    except DatabaseUnavailable:
        return []
    resumed = []
    for row in handed:
        if not m.places.room() or not await m.rows.take_handed(row.sandbox_id):
            continue
        try:
            await m.connect(row.sandbox_id, resume_timeout(row.end_at))
        except KeepStateError as exc:  # it stays paused here: a call resumes it
            log.warning("resuming sandbox %s, handed over to this node: %s", row.sandbox_id, exc)
            continue
        resumed.append(row.sandbox_id)
    return resumed


class CheckpointPolicy:
    """Every running sandbox whose policy asks for it is checkpointed every N seconds (see the module's text)."""

    def __init__(self, m: SandboxManager, every: int = 0) -> None:
        self.m = m
        self.every = every  # the server's policy (--checkpoint-every); 0: none
        self.taken = 0
        self.failed = 0
        self._at: dict[str, float] = {}  # sandbox -> monotonic time of its last policy checkpoint

    def interval(self, row: SandboxRow) -> int:
        return row.settings.checkpoint_every or self.every

    async def run(self) -> None:
        while True:
            await asyncio.sleep(POLICY_INTERVAL)
            await self.round()

    async def round(self) -> list[str]:
        """Checkpoint the sandboxes that are due, one at a time; their IDs."""
        m = self.m
        done: list[str] = []
        now = time.time()
        for row in m.table.running():
            every = self.interval(row)
            if every <= 0 or row.state != State.RUNNING or now - row.settings.checkpoint_at < every:
                continue
            sid = row.sandbox_id
            if m.idle.frozen(sid) and m.agents.last_active(sid) < self._at.get(sid, -math.inf):
                continue  # nothing ran since its last checkpoint
            try:
                self._at[sid] = time.monotonic()
                await m.checkpoint(sid, "policy")
            except (KeepStateError, OSError) as exc:  # gone, paused or killed meanwhile; the store failed
                self.failed += 1
                log.warning("the checkpoint policy's checkpoint of %s failed: %s", sid, exc)
                continue
            self.taken += 1
            done.append(sid)
        for sid in set(self._at) - {r.sandbox_id for r in m.table.running()}:
            del self._at[sid]
        return done
