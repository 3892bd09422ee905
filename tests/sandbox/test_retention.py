"""Lifetimes an operator sets, on the fake runtime: `--max-timeout` bounds every timeout a client asks (E2B's
"Timeout cannot be greater than 24 hours" by default, 0 for none), paused time is not counted (a paused sandbox's
end passes without it, and a resume starts its clock again), and `--paused-retention` deletes a sandbox paused for
longer, as a kill would (history: reason `retention`), unpublishes its pause checkpoints and collects their chunks
from the store, while one paused within it, or resumed meanwhile, is kept.

Time is moved, not waited for: a pause is aged by moving its `paused_at` back in the database."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime

import pytest
import sqlalchemy as sa

from keepstate.api.keys import RETENTION
from keepstate.db.schema import sandboxes as table
from keepstate.errors import BadRequest, Conflict
from keepstate.sandbox.creates import NO_LIMIT, check_timeout
from keepstate.sandbox.retention import Retention
from keepstate.sandbox.state import State
from keepstate.store import StoreError

from .conftest import Served, serving
from .test_lifecycle import create, events
from .test_races import read_file, write_file

DAY = 86400


def retention_of(s: Served) -> Retention:
    assert s.app is not None
    return s.app[RETENTION]


async def age(s: Served, sandbox_id: str, seconds: float) -> None:
    """As if the sandbox had been paused `seconds` longer (retention is judged by the database's clock)."""
    async with s.manager.db.transaction() as conn:
        await conn.execute(sa.update(table).where(table.c.sandbox_id == sandbox_id)
                           .values(paused_at=table.c.paused_at - seconds))


def end_of(info: dict[str, object]) -> float:
    return datetime.fromisoformat(str(info["endAt"]).replace("Z", "+00:00")).timestamp()


def checkpoints_of(s: Served, session_id: str) -> list[str]:
    return [m.checkpoint_id for m in s.manager.durable.repo.list_checkpoints() if m.meta.session_id == session_id]


# -- --max-timeout ------------------------------------------------------------------------------------------------
def test_the_limit_is_said_as_e2b_says_it() -> None:
    with pytest.raises(BadRequest, match="^Timeout cannot be greater than 24 hours$"):
        check_timeout(DAY + 1)
    with pytest.raises(BadRequest, match="^Timeout cannot be greater than 168 hours$"):
        check_timeout(7 * DAY + 0.5, limit=7 * DAY)
    with pytest.raises(BadRequest, match="^Timeout cannot be greater than 1 hour$"):
        check_timeout(3601, limit=3600)
    with pytest.raises(BadRequest, match="^Timeout cannot be greater than 5000 seconds$"):
        check_timeout(5001, limit=5000)
    assert check_timeout(30 * DAY, limit=0) == 30 * DAY  # 0: no limit
    with pytest.raises(BadRequest):
        check_timeout(NO_LIMIT + 1, limit=0)  # but still a time an end can be written as
    assert check_timeout(-DAY, limit=0) == -DAY  # set_timeout(-x): ends it now


async def test_max_timeout_by_default_is_e2bs_24_hours() -> None:
    async with serving() as s:
        too_long = {"code": 400, "message": "Timeout cannot be greater than 24 hours"}
        assert await s.call("POST", "/sandboxes", {"templateID": "base", "timeout": DAY + 1}) == (400, too_long)
        assert await s.call("POST", "/v2/sandboxes", {"templateID": "base", "timeout": DAY + 1}) == (400, too_long)
        sid, _ = await create(s, timeout=DAY)
        for path in ("timeout", "connect", "fork"):
            assert await s.call("POST", f"/sandboxes/{sid}/{path}", {"timeout": DAY + 1}) == (400, too_long), path
        assert await s.call("POST", f"/sandboxes/{sid}/resume", {"timeout": DAY + 1}) == (400, too_long)
        assert len(s.manager.listed()) == 1


async def test_max_timeout_the_operator_sets() -> None:
    async with serving(max_timeout=7 * DAY) as s:  # users ask for week-long sessions
        assert await s.call("POST", "/sandboxes", {"templateID": "base", "timeout": 8 * DAY}) == (
            400, {"code": 400, "message": "Timeout cannot be greater than 168 hours"})
        sid, _ = await create(s, timeout=7 * DAY)
        status, info = await s.call("GET", f"/sandboxes/{sid}")
        assert status == 200 and end_of(info) > time.time() + 6 * DAY
        assert (await s.call("POST", f"/sandboxes/{sid}/timeout", {"timeout": 8 * DAY}))[0] == 400
        assert (await s.call("POST", f"/sandboxes/{sid}/timeout", {"timeout": 3 * DAY}))[0] == 204
        status, info = await s.call("GET", f"/sandboxes/{sid}")
        assert status == 200 and end_of(info) < time.time() + 4 * DAY  # set-timeout may shorten it


async def test_max_timeout_zero_is_no_limit() -> None:
    async with serving(max_timeout=0) as s:
        sid, _ = await create(s, timeout=30 * DAY)
        assert (await s.call("POST", f"/sandboxes/{sid}/timeout", {"timeout": 365 * DAY}))[0] == 204
        status, info = await s.call("GET", f"/sandboxes/{sid}")
        assert status == 200 and end_of(info) > time.time() + 364 * DAY
        status, err = await s.call("POST", f"/sandboxes/{sid}/connect", {"timeout": NO_LIMIT + 1})
        assert status == 400 and err["message"].startswith("Timeout cannot be greater than")


async def test_paused_time_is_not_counted(served: Served) -> None:
    """A sandbox auto-paused at its timeout stays paused however long ago its end was; a resume gives it the
    resume's timeout from then."""
    s = served
    sid, token = await create(s, timeout=1, autoPause=True)
    await write_file(s, sid, token, "/home/user/a", b"kept while paused")
    deadline = time.monotonic() + 10
    while s.manager.records[sid].state != State.PAUSED:
        assert time.monotonic() < deadline, "not auto-paused"
        await asyncio.sleep(0.05)
    row = s.manager.records[sid]
    row.end_at = time.time() - 7 * DAY  # its end long past, while paused
    with pytest.raises(Conflict):
        await s.manager.expire(sid)  # nothing expires a paused sandbox
    assert s.manager.records[sid].state == State.PAUSED
    status, _ = await s.call("POST", f"/sandboxes/{sid}/connect", {"timeout": 600})
    assert status == 201
    status, info = await s.call("GET", f"/sandboxes/{sid}")
    assert status == 200 and info["state"] == "running" and end_of(info) > time.time() + 500  # from the resume
    assert await read_file(s, sid, token, "/home/user/a") == b"kept while paused"


# -- --paused-retention -------------------------------------------------------------------------------------------
async def test_a_sandbox_paused_past_its_retention_is_deleted_and_its_checkpoints_collected() -> None:
    async with serving(paused_retention=3600, retention_every=3600) as s:  # rounds run when the test says
        old, _ = await create(s)
        new, new_token = await create(s)
        await write_file(s, new, new_token, "/home/user/b", b"still here")
        for sid in (old, new):
            assert (await s.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204
        retention = retention_of(s)
        assert await retention.round() == [] and retention.last_gc is None  # nothing past an hour yet
        assert checkpoints_of(s, old) and checkpoints_of(s, new)
        before = s.manager.durable.repo.stored_bytes()

        await age(s, old, 2 * 3600)
        assert await retention.round() == [old]
        assert (await s.call("GET", f"/sandboxes/{old}"))[0] == 404
        status, err = await s.call("POST", f"/sandboxes/{old}/connect", {"timeout": 60})
        assert status == 404, err  # not loaded back from the store either: its checkpoints are unpublished
        assert await s.row(old) is None
        kill = (await events(s, old))[-1]
        assert kill["kind"] == "sandbox.kill" and kill["data"] == {"reason": "retention"}
        assert checkpoints_of(s, old) == [] and checkpoints_of(s, new) != []
        report = retention.last_gc
        assert report is not None and report.manifests_removed >= 1 and report.live_checkpoints >= 1
        assert s.manager.durable.repo.stored_bytes() < before  # its chunks are gone from the store
        assert not retention.gc_due

        assert await retention.round() == [] and retention.last_gc is report  # nothing new: no collection
        assert (await s.call("POST", f"/sandboxes/{new}/connect", {"timeout": 60}))[0] == 201
        assert await read_file(s, new, new_token, "/home/user/b") == b"still here"


async def test_a_checkpoint_the_store_will_not_unpublish_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(paused_retention=3600, retention_every=3600) as s:
        sid, _ = await create(s)
        assert (await s.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204
        await age(s, sid, 7200)
        repo, retention = s.manager.durable.repo, retention_of(s)

        def away(checkpoint_id: str) -> None:
            raise StoreError(f"the store is away: {checkpoint_id} stays")

        with monkeypatch.context() as patched:
            patched.setattr(repo, "delete_checkpoint", away)
            assert await retention.round() == [sid]  # deleted all the same
            assert retention.unpublish_later == checkpoints_of(s, sid) != [] and retention.last_gc is None
        assert await retention.round() == []
        assert checkpoints_of(s, sid) == [] and retention.unpublish_later == [] and retention.last_gc is not None


async def test_the_retention_loop_runs_by_itself() -> None:
    async with serving(paused_retention=0.2, retention_every=0.1) as s:
        sid, _ = await create(s)
        assert (await s.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204
        deadline = time.monotonic() + 20
        while (await s.call("GET", f"/sandboxes/{sid}"))[0] != 404:
            assert time.monotonic() < deadline, "not deleted"
            await asyncio.sleep(0.05)
        while retention_of(s).gc_due or retention_of(s).last_gc is None:
            assert time.monotonic() < deadline, "not collected"
            await asyncio.sleep(0.05)
        assert checkpoints_of(s, sid) == []


async def test_only_a_sandbox_still_paused_past_its_retention_is_deleted() -> None:
    async with serving(paused_retention=3600, retention_every=3600) as s:
        running, _ = await create(s)
        paused, _ = await create(s)
        assert (await s.call("POST", f"/sandboxes/{paused}/pause"))[0] == 204
        retention = retention_of(s)
        with pytest.raises(Conflict):  # resumed since the round found it: kept
            await retention._expire_one(running, 0.0, {})
        with pytest.raises(Conflict):  # paused within its retention
            await retention._expire_one(paused, 3600, {})
        assert s.manager.get(running).state == State.RUNNING and s.manager.get(paused).state == State.PAUSED
        assert (await s.call("POST", f"/sandboxes/{paused}/connect", {"timeout": 60}))[0] == 201
        await age(s, paused, 7200)  # running again: it has no pause to age
        assert await retention.round() == [] and len(s.manager.listed()) == 2


async def test_without_paused_retention_nothing_is_deleted() -> None:
    async with serving() as s:
        sid, _ = await create(s)
        assert (await s.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204
        await age(s, sid, 365 * DAY)
        retention = retention_of(s)
        assert retention._task is None and await retention.round() == []
        assert (await s.call("GET", f"/sandboxes/{sid}"))[1]["state"] == "paused"
