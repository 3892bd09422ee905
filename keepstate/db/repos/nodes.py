"""Nodes: who is in the cluster, and whose lease holds (docs/design/cluster.md, "Membership and leases").

One row per node name. A node joins as a new incarnation (the row's `incarnation` moves), renews its lease every
couple of seconds, and only the incarnation that holds the row can renew it: a renewal that matches nothing means the
node was declared dead (or removed) meanwhile, and must rejoin as a new incarnation. Every time a lease is judged by
is the database's own clock (`clock_timestamp()` on PostgreSQL, `julianday('now')` on SQLite), never a node's.

    nodes = Nodes(db)
    me = await nodes.join(NodeRecord(node_id="a", address="http://10.0.0.1:3000", ...), ttl_s=10)
    expires, state = await nodes.renew("a", me.incarnation, ttl_s=10)   # None: not ours any more
    dead = await nodes.expire(grace_s=10, max_dead_fraction=0.5)     # the reaper (any node may run it)
"""

from __future__ import annotations

import builtins
import json
from typing import Any

import sqlalchemy as sa

from keepstate.db.engine import Conn, Database
from keepstate.db.records import NodeRecord
from keepstate.db.repos._sql import insert_or_ignore
from keepstate.db.schema import nodes

_c = nodes.c
LIVE = ("alive", "draining")  # states that hold a lease


def db_now(kind: str) -> sa.ColumnElement[float]:
    """The database's clock, in seconds since the epoch."""
    if kind == "postgresql":
        return sa.cast(sa.func.extract("epoch", sa.func.clock_timestamp()), sa.Float)
    return (sa.func.julianday("now") - 2440587.5) * 86400.0


class Nodes:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def now(self) -> float:
        """The database's clock (what `lease_expires_at` is compared with)."""
        async with self.db.read() as conn:
            return float((await conn.execute(sa.select(db_now(self.db.kind)))).scalar_one())

    async def join(self, node: NodeRecord, ttl_s: float) -> NodeRecord:
        """Record the node as a new incarnation holding a lease of `ttl_s`: its row replaced whole (a node that
        comes back after it was declared dead, or after it left, joins again). The stored record."""
        now = db_now(self.db.kind)
        values: dict[str, Any] = {
            "address": node.address, "cpus": node.cpus, "memory_mb": node.memory_mb,
            "max_sandboxes": node.max_sandboxes, "runsc_release": node.runsc_release,
            "cpu_features": json.dumps(list(node.cpu_features)), "templates": json.dumps(list(node.templates)),
            "metrics": node.metrics, "state": "alive", "joined_at": now, "lease_expires_at": now + ttl_s}
        async with self.db.transaction() as conn:
            # Two joins of one new name at once: the row is made by whichever inserts first (the other's insert is
            # ignored, after waiting for it on PostgreSQL), then each moves the incarnation on under the row's lock;
            # the later join holds it, and the earlier finds its renewals refused (it rejoins, or its operator sees
            # two servers claim one name).
            await conn.execute(insert_or_ignore(self.db.kind, nodes, ["node_id"], {
                "node_id": node.node_id, "incarnation": 0, **values, "state": "left"}))
            await conn.execute(sa.select(_c.incarnation).where(_c.node_id == node.node_id).with_for_update())
            await conn.execute(nodes.update().where(_c.node_id == node.node_id)
                               .values(incarnation=_c.incarnation + 1, **values))
            stored = await _get(conn, node.node_id)
        assert stored is not None
        return stored

    async def renew(self, node_id: str, incarnation: int, ttl_s: float,
                    metrics: str | None = None) -> tuple[float, str] | None:
        """Extend the lease of this incarnation to the database's now + `ttl_s`; the new expiry and the node's state
        (`alive`, or `draining` if an operator drained it), or None if the incarnation no longer holds the row
        (declared dead, removed, or a newer incarnation joined)."""
        values: dict[str, Any] = {"lease_expires_at": db_now(self.db.kind) + ttl_s}
        if metrics is not None:
            values["metrics"] = metrics
        async with self.db.transaction() as conn:
            done = await conn.execute(
                nodes.update().where(_c.node_id == node_id, _c.incarnation == incarnation, _c.state.in_(LIVE))
                .values(**values).returning(_c.lease_expires_at, _c.state))
            row = done.first()
        return (float(row.lease_expires_at), str(row.state)) if row is not None else None

    async def leave(self, node_id: str, incarnation: int) -> bool:
        """The incarnation leaves (a clean stop): its lease ends now. False if it no longer held the row."""
        async with self.db.transaction() as conn:
            done = await conn.execute(
                nodes.update().where(_c.node_id == node_id, _c.incarnation == incarnation, _c.state.in_(LIVE))
                .values(state="left", lease_expires_at=db_now(self.db.kind)))
            return done.rowcount == 1

    async def drain(self, node_id: str) -> bool:
        """A live node takes no more creates (its lease goes on). False if there is no live node of that name."""
        async with self.db.transaction() as conn:
            done = await conn.execute(nodes.update().where(_c.node_id == node_id, _c.state == "alive")
                                      .values(state="draining"))
            return done.rowcount == 1

    async def remove(self, node_id: str) -> bool:
        """Forget the node (an operator's decision: it is not coming back, or will join anew). Its row stays as a
        tombstone (`removed`) so that its incarnations never repeat: a node still running finds its renewals refused
        and rejoins as a new incarnation. False if it was removed already or never joined."""
        async with self.db.transaction() as conn:
            done = await conn.execute(nodes.update().where(_c.node_id == node_id, _c.state != "removed")
                                      .values(state="removed", lease_expires_at=db_now(self.db.kind)))
            return done.rowcount == 1

    async def get(self, node_id: str) -> NodeRecord | None:
        async with self.db.read() as conn:
            return await _get(conn, node_id)

    async def list(self) -> builtins.list[NodeRecord]:
        """Every node but the removed ones, by name."""
        return (await self.shown())[0]

    async def shown(self) -> tuple[builtins.list[NodeRecord], float]:
        """`list()` and the database's `now()` in one read: what `GET /nodes` and `keepstate nodes ls` show."""
        async with self.db.read() as conn:
            rows = await conn.execute(sa.select(nodes).where(_c.state != "removed").order_by(_c.node_id))
            found = [node_record(r) for r in rows]
            return found, float((await conn.execute(sa.select(db_now(self.db.kind)))).scalar_one())

    async def expire(self, grace_s: float, max_dead_fraction: float = 0.5,
                     spare: str | None = None) -> builtins.list[NodeRecord]:
        """The reaper: declare dead every live node whose lease expired more than `grace_s` ago (by the database's
        clock), in one transaction; the nodes declared dead. Idempotent: any node may run it. `spare`: a node never
        declared here (the caller's own). If more than `max_dead_fraction` of the live nodes would be declared dead
        at once, none is: that is the database's outage or restart speaking (every lease looks expired then), not
        the nodes' deaths (Kubernetes' rule for a zone mostly unhealthy)."""
        now = db_now(self.db.kind)
        async with self.db.transaction() as conn:
            live = (await conn.execute(sa.select(_c.node_id, _c.incarnation, (_c.lease_expires_at < now - grace_s)
                                                 .label("expired")).where(_c.state.in_(LIVE)))).all()
            expired = [(r.node_id, r.incarnation) for r in live if r.expired and r.node_id != spare]
            if not expired or len(expired) > max_dead_fraction * len(live):
                return []
            dead = []
            for node_id, incarnation in expired:
                done = await conn.execute(
                    nodes.update().where(_c.node_id == node_id, _c.incarnation == incarnation, _c.state.in_(LIVE),
                                         _c.lease_expires_at < now - grace_s)
                    .values(state="dead"))
                if done.rowcount == 1:
                    found = await _get(conn, node_id)
                    assert found is not None
                    dead.append(found)
            return dead


async def _get(conn: Conn, node_id: str) -> NodeRecord | None:
    row = (await conn.execute(sa.select(nodes).where(_c.node_id == node_id))).first()
    return node_record(row) if row is not None else None


def node_record(row: Any) -> NodeRecord:
    """A `nodes` row as its record (placement.py reads them joined)."""
    return NodeRecord(node_id=row.node_id, address=row.address, cpus=float(row.cpus), memory_mb=int(row.memory_mb),
                      max_sandboxes=int(row.max_sandboxes), runsc_release=row.runsc_release,
                      cpu_features=tuple(json.loads(row.cpu_features)), templates=tuple(json.loads(row.templates)),
                      incarnation=int(row.incarnation), state=row.state, metrics=row.metrics,
                      joined_at=float(row.joined_at), lease_expires_at=float(row.lease_expires_at))
