"""Placement's reads (docs/design/cluster.md, "Placement"): the live nodes and what their sandboxes hold, in one
read judged by the database's clock. The choice among them is keepstate.cluster.placement's; the reservation is the
row the chosen node writes before it starts the instance (sandbox/instances.py), which every later read counts.

    loads = await Placement(db).loads()      # [NodeLoad(node=NodeRecord, sandboxes=3, cpu=6.0, memory_mb=3072)]
"""

from __future__ import annotations

import sqlalchemy as sa

from keepstate.db.engine import Database
from keepstate.db.records import NodeLoad
from keepstate.db.repos.nodes import db_now, node_record
from keepstate.db.schema import nodes, sandboxes

# The states of a row whose instance holds a place on its node's host (a paused one's standby is the node's own
# count: it is not shared).
HOLDING = ("pooled", "running", "checkpointing", "pausing", "resuming", "killing")

_s = sandboxes.c


class Placement:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def loads(self, states: tuple[str, ...] = ("alive",)) -> list[NodeLoad]:
        """Every node in `states` whose lease holds now, by name, with its sandboxes' count, CPUs and memory."""
        held = (sa.select(_s.node_id, sa.func.count().label("n"), sa.func.coalesce(sa.func.sum(_s.cpu), 0.0)
                          .label("cpu"), sa.func.coalesce(sa.func.sum(_s.memory_mb), 0).label("mem"))
                .where(_s.state.in_(HOLDING)).group_by(_s.node_id).subquery())
        query = (sa.select(nodes, held.c.n, held.c.cpu, held.c.mem)
                 .select_from(nodes.outerjoin(held, held.c.node_id == nodes.c.node_id))
                 .where(nodes.c.state.in_(states), nodes.c.lease_expires_at > db_now(self.db.kind))
                 .order_by(nodes.c.node_id))
        async with self.db.read() as conn:
            return [NodeLoad(node=node_record(r), sandboxes=int(r.n or 0), cpu=float(r.cpu or 0.0),
                             memory_mb=int(r.mem or 0)) for r in await conn.execute(query)]
