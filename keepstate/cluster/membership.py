"""This node's place in the cluster: joined at start, its lease renewed, fenced when it cannot renew, left at stop
(docs/design/cluster.md, "Membership and leases").

    membership = Membership(Nodes(db), me, fencing=True, on_fence=..., on_unfence=...)
    await membership.join()
    task = create_task(membership.run())     # renews every RENEW_S; reaps nodes whose lease expired
    ...
    await membership.leave()

The lease is judged by the database's clock (the repository's `renew` sets it to the database's now + TTL). The
node judges its own fence on its *monotonic* clock only: T0 is when it sent its last renewal that succeeded, and at
T0 + TTL - FENCE_MARGIN_S it fences itself (it serves nothing for its sandboxes), which is before the database's
expiry whatever the two clocks read, as long as their rates agree (the lease assumption of Chubby and etcd). A later
renewal of the same incarnation lifts the fence. A renewal that matches nothing means this incarnation was declared
dead or removed: the node stays fenced, tells `on_lost` (its sandboxes are not its own any more), and rejoins as a
new incarnation.

Any node reaps: each round, once it has been connected for 2 TTL (so that a database that was away, and restarted
with every lease looking expired, declares nobody dead at once), it asks the repository to declare dead the nodes
whose lease expired more than FENCE_MARGIN_S ago, and tells `on_dead`. The dead node fenced itself at least
FENCE_MARGIN_S before its lease expired: by then it has been still for twice that margin.

Without `fencing` (a single server, `--node` not given) the lease is kept and shown, and nothing is ever fenced: a
database that goes away then only makes calls that need it answer 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from keepstate.db.errors import DatabaseUnavailable
from keepstate.db.records import NodeRecord
from keepstate.db.repos import Nodes

log = logging.getLogger("keepstate.cluster")

TTL_S = 10.0  # a lease's length, set at each renewal by the database's clock
RENEW_S = 2.0  # how often it is renewed
FENCE_MARGIN_S = 2.0  # the node fences itself this long before its lease would expire
MAX_DEAD_FRACTION = 0.5  # more of the live nodes than this expiring at once is the database's outage, not deaths


class Membership:
    def __init__(self, nodes: Nodes, me: NodeRecord, *, fencing: bool = True, ttl_s: float = TTL_S,
                 renew_s: float = RENEW_S, fence_margin_s: float = FENCE_MARGIN_S,
                 metrics: Callable[[], dict[str, Any]] | None = None,
                 on_fence: Callable[[str], None] | None = None, on_unfence: Callable[[], None] | None = None,
                 on_lost: Callable[[], Awaitable[None]] | None = None,
                 on_dead: Callable[[list[NodeRecord]], Awaitable[None]] | None = None) -> None:
        assert fence_margin_s < ttl_s and renew_s < ttl_s - fence_margin_s
        self.nodes = nodes
        self.me = me
        self.fencing = fencing
        self.ttl_s, self.renew_s, self.fence_margin_s = ttl_s, renew_s, fence_margin_s
        self.metrics = metrics or (lambda: {})
        self.on_fence = on_fence or (lambda why: None)
        self.on_unfence = on_unfence or (lambda: None)
        self.on_lost = on_lost
        self.on_dead = on_dead
        self.fenced: str | None = None  # why this node serves nothing now; None: it serves
        self.state = "alive"  # as its last renewal found it: `draining` once an operator drained it
        self.last_ok = 0.0  # monotonic time the last renewal that succeeded was sent
        self._connected_since: float | None = None  # monotonic start of the current run of good renewals
        self._said = ""  # the renewal failure last logged (said once until it changes)

    @property
    def incarnation(self) -> int:
        return self.me.incarnation

    # -- joining and leaving ------------------------------------------------------------------------------------
    async def join(self) -> NodeRecord:
        sent = time.monotonic()
        self.me = await self.nodes.join(self.me, self.ttl_s)
        self.state = self.me.state
        self._ok(sent)
        log.info("node %s joined as incarnation %d (%s)", self.me.node_id, self.me.incarnation, self.me.address)
        return self.me

    async def leave(self) -> None:
        """A clean stop: the lease ends now (best effort: a database that is away lets it expire instead)."""
        try:
            async with asyncio.timeout(self.renew_s):
                await self.nodes.leave(self.me.node_id, self.me.incarnation)
            log.info("node %s (incarnation %d) left", self.me.node_id, self.me.incarnation)
        except (DatabaseUnavailable, TimeoutError) as exc:
            log.warning("node %s could not say it leaves (%r): its lease will expire", self.me.node_id, exc)

    # -- the loop -------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            started = time.monotonic()
            await self.renew_once()
            if self._connected_since is not None and started - self._connected_since >= 2 * self.ttl_s:
                await self.reap_once()
            # Wake for the next renewal, or sooner if the fence's deadline comes first.
            next_at = started + self.renew_s
            if self.fencing and self.fenced is None:
                next_at = min(next_at, self.last_ok + self.ttl_s - self.fence_margin_s)
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            self.check_fence()

    async def renew_once(self) -> None:
        sent = time.monotonic()
        budget = max(0.1, self.last_ok + self.ttl_s - self.fence_margin_s - sent)  # never wait past the fence
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancellation that arrives as the renewal
            # ends (gh-86296), and this loop would then never stop.
            async with asyncio.timeout(budget):
                renewed = await self.nodes.renew(self.me.node_id, self.me.incarnation, self.ttl_s,
                                                 json.dumps(self.metrics()))
        except (DatabaseUnavailable, TimeoutError, OSError) as exc:
            self._connected_since = None
            self._say(f"cannot renew its lease: {exc!r}")
            self.check_fence()
            return
        if renewed is None:
            await self._lost()
            return
        if renewed[1] != self.state:
            log.warning("node %s is %s now", self.me.node_id, renewed[1])
            self.state = renewed[1]
        self._ok(sent)

    def check_fence(self) -> None:
        """Fence now if the lease may be about to expire in the database (monotonic clock only)."""
        if self.fencing and self.fenced is None and time.monotonic() >= self.last_ok + self.ttl_s - self.fence_margin_s:
            self._fence(f"its lease could not be renewed for {self.ttl_s - self.fence_margin_s:.0f} s")

    async def reap_once(self) -> list[NodeRecord]:
        try:
            dead = await self.nodes.expire(self.fence_margin_s, MAX_DEAD_FRACTION, spare=self.me.node_id)
        except DatabaseUnavailable as exc:
            log.debug("reaping: %s", exc)
            return []
        for node in dead:
            log.warning("node %s (incarnation %d) declared dead: its lease expired at %.0f", node.node_id,
                        node.incarnation, node.lease_expires_at)
        if dead and self.on_dead is not None:
            await self.on_dead(dead)
        return dead

    # -- states ---------------------------------------------------------------------------------------------------
    def _ok(self, sent: float) -> None:
        self.last_ok = sent
        if self._connected_since is None:
            self._connected_since = sent
        if self._said:
            log.info("node %s renews its lease again", self.me.node_id)
            self._said = ""
        if self.fenced is not None:
            log.warning("node %s is no longer fenced", self.me.node_id)
            self.fenced = None
            self.on_unfence()

    def _fence(self, why: str) -> None:
        self.fenced = why
        log.error("node %s fences itself: %s", self.me.node_id, why)
        self.on_fence(why)

    async def _lost(self) -> None:
        """This incarnation no longer holds its row: declared dead, or removed by an operator."""
        self._fence(f"incarnation {self.me.incarnation} was declared dead or removed")
        if self.on_lost is not None:
            await self.on_lost()
        self.me = replace(self.me, incarnation=0)
        await self.join()  # lifts the fence: a new incarnation owns nothing it did not take

    def _say(self, what: str) -> None:
        if what != self._said:
            log.warning("node %s %s", self.me.node_id, what)
            self._said = what
