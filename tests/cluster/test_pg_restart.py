"""Restarting PostgreSQL declares nobody dead (docs/design/cluster.md, "Membership and leases"): while it is down
every node fences itself (no lease can be renewed), every lease expires by the database's clock, and once it is back
each node renews the incarnation it had, lifts its fence and serves its sandboxes again; no reaper declares a node
dead, and no sandbox moves."""

from __future__ import annotations

import asyncio
import contextlib

from keepstate.api.nodes import MEMBERSHIP
from keepstate.db.repos import Nodes, Sandboxes
from keepstate.testing.databases import require_postgres
from keepstate.testing.postgres import PostgresServer

from ..sandbox.conftest import serving

LEASE = (1.0, 0.1, 0.4)


async def test_a_postgresql_restart_declares_nobody_dead() -> None:
    require_postgres()
    with PostgresServer() as pg:
        url = pg.createdb("restart")
        async with contextlib.AsyncExitStack() as stack:
            a = await stack.enter_async_context(serving(node="a", db_url=url, lease=LEASE, pool_size=0))
            b = await stack.enter_async_context(serving(node="b", db_url=url, key=a.key, lease=LEASE, pool_size=0))
            made = {}
            for s in (a, b):
                status, body = await s.call("POST", "/sandboxes", {"templateID": "base", "timeout": 600})
                assert status == 201, body
                made[body["sandboxID"]] = body
            before = {n.node_id: n.incarnation for n in await Nodes(a.manager.db).list()}
            epochs = {sid: (await Sandboxes(a.manager.db).get(sid)).epoch for sid in made}  # type: ignore[union-attr]
            memberships = [s.app[MEMBERSHIP] for s in (a, b) if s.app is not None]
            await asyncio.to_thread(pg.shutdown)
            async with asyncio.timeout(30):
                while any(m.fenced is None for m in memberships):  # both fence themselves by their own clocks
                    await asyncio.sleep(0.05)
            await asyncio.sleep(3 * LEASE[0])  # every lease is long expired by the database's clock now
            await asyncio.to_thread(pg.restart)
            async with asyncio.timeout(30):
                while any(m.fenced is not None for m in memberships):
                    await asyncio.sleep(0.05)
            await asyncio.sleep(4 * LEASE[0])  # past the reapers' wait of two leases of good renewals, and a round
            nodes = await Nodes(a.manager.db).list()
            assert {n.node_id: (n.state, n.incarnation) for n in nodes} == {k: ("alive", v) for k, v in before.items()}
            for sid in made:
                found = await Sandboxes(a.manager.db).get(sid)
                assert found is not None and found.epoch == epochs[sid] and found.state == "running"
                for s in (a, b):  # each served by its node, through either
                    status, info = await s.call("GET", f"/sandboxes/{sid}")
                    assert status == 200 and info["state"] == "running", info
