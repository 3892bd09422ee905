"""Warm pools of built templates (keepstate/sandbox/creates.py, docs/design/template-builds.md), on the fake
runtime: a built template's first create starts a pool of sandboxes restored from its checkpoint; later creates
claim them; a rebuild, a delete or a long quiet retires the pool, and its sandboxes are torn down.

A built template is a snapshot the template builder's resolver names; here a snapshot of a sandbox with a file,
named through the same hook (`manager.template_resolver`) the builder sets.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

from keepstate.sandbox import creates
from keepstate.sandbox.record import Snapshot
from keepstate.sandbox.state import State
from keepstate.testing import FakeRuntime

from .conftest import Served, serving
from .test_idle import bounded, create, fake, until
from .test_races import read_file, write_file


async def snapshot_with(s: Served, content: bytes) -> Snapshot:
    sid, token = await create(s)
    await bounded(write_file(s, sid, token, "/home/user/built", content))
    status, snap = await bounded(s.call("POST", f"/sandboxes/{sid}/snapshots", {}))
    assert status == 201, snap
    row = await s.stored.find_snapshot(snap["snapshotID"])
    assert row is not None
    return row


def name_template(s: Served, snaps: dict[str, Snapshot]) -> None:
    """`Sandbox.create("tpl")` resolves to snaps["tpl"], as a built template (one with a pool)."""

    async def resolve(ref: str) -> Snapshot | None:
        return replace(snaps[ref], pool=ref) if ref in snaps else None

    s.manager.template_resolver = resolve


async def create_from(s: Served, ref: str, **body: Any) -> tuple[str, str]:
    status, sbx = await bounded(s.call("POST", "/sandboxes", {"templateID": ref, "timeout": 300, **body}))
    assert status == 201, sbx
    return sbx["sandboxID"], sbx["envdAccessToken"]


def pool_of(s: Served, ref: str) -> creates.SnapshotPool | None:
    return next((p for p in s.manager.creates.snapshot_pools.values() if p.pool.template == ref), None)


async def ready_pool(s: Served, ref: str) -> creates.SnapshotPool:
    held = await until(lambda: pool_of(s, ref), f"the pool of {ref}")
    await until(lambda: len(held.pool) > 0, f"a sandbox in the pool of {ref}")
    return held


def live(s: Served, runtime_name: str) -> bool:
    return runtime_name in fake(s).names()


async def test_a_create_claims_a_restore_of_the_template_made_ahead_of_it() -> None:
    async with serving(template_pool_size=1) as s:
        name_template(s, {"tpl": await snapshot_with(s, b"from the template")})
        first, _ = await create_from(s, "tpl")  # no pool yet: restored for this create; the pool starts
        held = await ready_pool(s, "tpl")
        pooled = held.pool.ready()[0]
        assert pooled.state == State.POOLED and pooled.sandbox_id not in s.manager.records
        sid, token = await create_from(s, "tpl", envVars={"MINE": "yes"}, metadata={"who": "claimed"})
        assert held.pool.claims == 1
        assert sid == pooled.sandbox_id and sid != first  # the pooled sandbox, under the ID it was restored with
        row = s.manager.records[sid]
        assert row.state == State.RUNNING and row.settings.metadata == {"who": "claimed"}
        assert row.settings.env_vars.get("MINE") == "yes"
        assert await s.row(sid) is not None
        assert await bounded(read_file(s, sid, token, "/home/user/built")) == b"from the template"
        status, info = await bounded(s.call("GET", f"/sandboxes/{sid}"))
        assert status == 200 and info["metadata"] == {"who": "claimed"}, info
        await until(lambda: len(held.pool) > 0, "the pool to refill")
        assert held.pool.ready()[0].sandbox_id != sid


async def test_concurrent_creates_past_the_pool_get_a_sandbox_each() -> None:
    async with serving(template_pool_size=1) as s:
        name_template(s, {"tpl": await snapshot_with(s, b"shared start")})
        await create_from(s, "tpl")
        await ready_pool(s, "tpl")
        made = await asyncio.gather(*(create_from(s, "tpl") for _ in range(4)))
        assert len({sid for sid, _ in made}) == 4
        for i, (sid, token) in enumerate(made):
            await bounded(write_file(s, sid, token, "/home/user/mine", f"{i}".encode()))
        for i, (sid, token) in enumerate(made):
            assert await bounded(read_file(s, sid, token, "/home/user/mine")) == f"{i}".encode()
            assert await bounded(read_file(s, sid, token, "/home/user/built")) == b"shared start"


async def test_a_rebuilt_template_is_never_served_from_the_old_builds_pool() -> None:
    async with serving(template_pool_size=1) as s:
        snaps = {"tpl": await snapshot_with(s, b"build one")}
        name_template(s, snaps)
        await create_from(s, "tpl")
        old = await ready_pool(s, "tpl")
        old_name = old.pool.ready()[0].runtime_name
        snaps["tpl"] = await snapshot_with(s, b"build two")  # the template's ref now resolves to a new checkpoint
        sid, token = await create_from(s, "tpl")
        assert await bounded(read_file(s, sid, token, "/home/user/built")) == b"build two"
        assert old.manifest.checkpoint_id not in s.manager.pools
        await until(lambda: not live(s, old_name), "the old build's pooled sandbox to be torn down")
        new = await ready_pool(s, "tpl")
        assert new.manifest.checkpoint_id == snaps["tpl"].checkpoint_id


async def test_a_pool_no_create_came_for_is_drained() -> None:
    async with serving(template_pool_size=1) as s:
        name_template(s, {"tpl": await snapshot_with(s, b"idle")})
        await create_from(s, "tpl")
        held = await ready_pool(s, "tpl")
        name = held.pool.ready()[0].runtime_name
        s.manager.creates.trim(time.monotonic() + creates.TEMPLATE_POOL_IDLE / 2)
        assert pool_of(s, "tpl") is held  # not yet
        s.manager.creates.trim(time.monotonic() + creates.TEMPLATE_POOL_IDLE + 1)
        assert pool_of(s, "tpl") is None and held.manifest.checkpoint_id not in s.manager.pools
        await until(lambda: not live(s, name), "the drained pool's sandbox to be torn down")
        sid, token = await create_from(s, "tpl")  # a create after that restores again, and starts a new pool
        assert await bounded(read_file(s, sid, token, "/home/user/built")) == b"idle"
        await ready_pool(s, "tpl")


async def test_a_restart_reaps_pooled_restores_and_the_next_create_refills() -> None:
    runtime = FakeRuntime()  # both servers' (the second adopts the first's instances): closed after both
    try:
        async with serving(runtime=runtime, template_pool_size=1, reap_on_exit=False) as s:
            snaps = {"tpl": await snapshot_with(s, b"before the restart")}
            name_template(s, snaps)
            await create_from(s, "tpl")
            held = await ready_pool(s, "tpl")
            name, home = held.pool.ready()[0].runtime_name, s.home
        async with serving(home=home, runtime=runtime, template_pool_size=1) as s2:
            await until(lambda: not live(s2, name), "the pooled restore to be reaped by adoption")
            assert all(p.template != "tpl" for p in s2.manager.pools.values())
            name_template(s2, snaps)
            sid, token = await create_from(s2, "tpl")
            assert await bounded(read_file(s2, sid, token, "/home/user/built")) == b"before the restart"
            await ready_pool(s2, "tpl")
    finally:
        runtime.close()


async def test_no_pool_when_disabled() -> None:
    async with serving(template_pool_size=0) as s:
        name_template(s, {"tpl": await snapshot_with(s, b"x")})
        for _ in range(2):
            await create_from(s, "tpl")
        assert pool_of(s, "tpl") is None
        pooled = {r.runtime_name for p in s.manager.pools.values() for r in p.ready()}
        assert set(fake(s).names()) - pooled == {r.runtime_name for r in s.manager.records.values()}
