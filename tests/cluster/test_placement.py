"""Placement (docs/design/cluster.md, "Placement"): a create through any node lands on a node the database's figures
choose, best of K; a node never holds more than its limit, however many creates arrive at once through however many
nodes; a full cluster answers 503 with Retry-After; a create placed elsewhere is used through any node."""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
from collections import Counter

from keepstate.cluster.placement import has_room, ranked, score
from keepstate.db.records import NodeLoad, NodeRecord
from keepstate.db.repos.placement import Placement
from keepstate.sandbox.admission import AdmissionConfig
from keepstate.testing.databases import postgres  # noqa: F401
from keepstate.testing.postgres import PostgresServer

from ..sandbox.conftest import Served, serving
from ..sandbox.test_races import read_file, write_file

LEASE = (2.0, 0.2, 0.6)
LIMIT = 4  # sandboxes a node holds at most (--max-sandboxes)


def load(name: str, n: int, cpu: float = 0.0, max_sandboxes: int = 10, templates: tuple[str, ...] = ()) -> NodeLoad:
    node = NodeRecord(node_id=name, address=f"http://{name}", cpus=8, memory_mb=16384, max_sandboxes=max_sandboxes,
                      runsc_release="r", templates=templates)
    return NodeLoad(node=node, sandboxes=n, cpu=cpu, memory_mb=512 * n)


def test_ranking_prefers_free_nodes_and_warm_templates_and_skips_full_ones() -> None:
    loads = [load("a", 9, cpu=7), load("b", 1, cpu=1), load("full", 10)]
    assert not has_room(loads[2])
    # With every node drawn, the freer one comes first; the full one is never offered.
    assert [n.node_id for n in ranked(loads, 1, 512, "base", k=3)] == ["b", "a"]
    assert score(load("w", 2, templates=("base",)), 1, 512, "base") > score(load("c", 2), 1, 512, "base")
    # Best of K: over many draws the busiest node is chosen only when it is drawn against itself, i.e. never with K=2
    # of 3 free-ish nodes, and the two freer ones share the first place.
    three = [load("x", 0), load("y", 0), load("z", 8)]
    first = Counter(ranked(three, 1, 512, None, rng=random.Random(seed))[0].node_id for seed in range(300))
    assert first["z"] == 0 and first["x"] > 50 and first["y"] > 50
    assert ranked([], 1, 512, None) == []


async def sandboxes_per_node(s: Served) -> dict[str, int]:
    loads = await Placement(s.manager.db).loads(("alive", "draining"))
    return {ld.node.node_id: ld.sandboxes for ld in loads}


async def test_concurrent_creates_across_three_nodes_never_oversubscribe_a_node(
        postgres: PostgresServer) -> None:  # noqa: F811
    url = postgres.createdb(f"placement_{secrets.token_hex(6)}")
    options = {"db_url": url, "lease": LEASE, "pool_size": 0, "admission": AdmissionConfig(max_sandboxes=LIMIT)}
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(serving(node="a", **options))  # type: ignore[arg-type]
        b = await stack.enter_async_context(serving(node="b", key=a.key, **options))  # type: ignore[arg-type]
        c = await stack.enter_async_context(serving(node="c", key=a.key, **options))  # type: ignore[arg-type]
        nodes = [a, b, c]

        async def create(i: int) -> tuple[int, dict[str, str], object]:
            s = nodes[i % 3]
            async with s.http.post(s.url + "/sandboxes", json={"templateID": "base", "timeout": 120},
                                   headers=s.headers) as r:
                return r.status, dict(r.headers), await r.json()

        answers = await asyncio.gather(*(create(i) for i in range(20)))
        made = [body for status, _, body in answers if status == 201]
        refused = [(status, headers, body) for status, headers, body in answers if status != 201]
        assert len(made) == 3 * LIMIT, answers  # every place taken, no more
        for status, headers, body in refused:  # the documented busy answer, never a 500
            assert status == 503 and int(headers["Retry-After"]) >= 1, (status, body)
        held = {s.manager.rows.node_id: len(s.manager.listed()) for s in nodes}
        assert held == {"a": LIMIT, "b": LIMIT, "c": LIMIT}
        assert await sandboxes_per_node(a) == held  # the database agrees with each node
        # Each sandbox answers through every node (relayed to its owner), whichever node it was created through.
        sid, token = made[0]["sandboxID"], made[0]["envdAccessToken"]  # type: ignore[index]
        await write_file(b, sid, token, "/home/user/placed.txt", b"placed")
        for s in nodes:
            assert await read_file(s, sid, token, "/home/user/placed.txt") == b"placed"
            status, info = await s.call("GET", f"/sandboxes/{sid}")
            assert status == 200 and info["sandboxID"] == sid


async def test_creates_through_one_node_spread_and_skip_a_drained_node(postgres: PostgresServer) -> None:  # noqa: F811
    url = postgres.createdb(f"placement_{secrets.token_hex(6)}")
    options = {"db_url": url, "lease": LEASE, "pool_size": 0}
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(serving(node="a", **options))  # type: ignore[arg-type]
        b = await stack.enter_async_context(serving(node="b", key=a.key, **options))  # type: ignore[arg-type]
        c = await stack.enter_async_context(serving(node="c", key=a.key, **options))  # type: ignore[arg-type]
        from keepstate.api.placement import PLACER

        assert a.app is not None
        a.app[PLACER].rng = random.Random(27)  # best of two is drawn at random: a seeded draw, the same every run
        for _ in range(9):
            status, made = await a.call("POST", "/sandboxes", {"templateID": "base", "timeout": 120})
            assert status == 201, made
        spread = {s.manager.rows.node_id: len(s.manager.listed()) for s in (a, b, c)}
        assert sum(spread.values()) == 9 and max(spread.values()) - min(spread.values()) <= 2, spread
        # A drained node takes no creates, even those sent to it: they land on the others.
        from keepstate.api.nodes import MEMBERSHIP
        from keepstate.db.repos import Nodes

        assert await Nodes(a.manager.db).drain("c")
        assert c.app is not None
        while c.app[MEMBERSHIP].state != "draining":
            await asyncio.sleep(0.05)
        before = len(c.manager.listed())
        for s in (a, c):
            status, made = await s.call("POST", "/sandboxes", {"templateID": "base", "timeout": 120})
            assert status == 201, made
            owner = await s.manager.rows.owner(made["sandboxID"])
            assert owner in ("a", "b")
        assert len(c.manager.listed()) == before


def test_a_checkpoint_resumes_only_under_its_runsc_release_on_a_cpu_with_its_features() -> None:
    from keepstate.cluster.placement import incompatible

    origin = NodeRecord(node_id="a", address="", cpus=1, memory_mb=1, max_sandboxes=1, runsc_release="r1",
                        cpu_features=("avx2", "sse4_2"))
    same = NodeRecord(node_id="b", address="", cpus=1, memory_mb=1, max_sandboxes=1, runsc_release="r1",
                      cpu_features=("avx2", "avx512f", "sse4_2"))
    assert incompatible(same, origin) is None
    assert "avx2" in str(incompatible(NodeRecord(node_id="c", address="", cpus=1, memory_mb=1, max_sandboxes=1,
                                                 runsc_release="r1", cpu_features=("sse4_2",)), origin))
    assert "r2" in str(incompatible(NodeRecord(node_id="d", address="", cpus=1, memory_mb=1, max_sandboxes=1,
                                               runsc_release="r2", cpu_features=("avx2", "sse4_2")), origin))
