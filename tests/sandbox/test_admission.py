"""Admission (docs/design/admission.md): the start queue's K/Q/W and its order, and the host's and API keys' limits
under concurrent creates, on the fake runtime."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from keepstate.apikeys import find, issue
from keepstate.errors import Busy, Unavailable
from keepstate.sandbox.admission import AdmissionConfig, StartQueue
from keepstate.sandbox.state import State
from keepstate.testing import FakeRuntime

from .conftest import Served, serving


async def until(condition: Callable[[], bool]) -> None:
    """Let the other tasks run until `condition` holds (no clock involved)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


class Starts:
    """Tasks that take a start slot and hold it until told to let go, recording the order they got it in."""

    def __init__(self, queue: StartQueue) -> None:
        self.queue = queue
        self.order: list[str] = []
        self.release: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, name: str, refill: bool = False) -> asyncio.Task[None]:
        self.release[name] = asyncio.Event()

        async def run() -> None:
            async with self.queue.slot(refill):
                self.order.append(name)
                await self.release[name].wait()

        self.tasks[name] = asyncio.get_running_loop().create_task(run())
        return self.tasks[name]

    async def let_go(self, name: str) -> None:
        self.release[name].set()
        await self.tasks[name]


# -- the start queue ----------------------------------------------------------------------------------------------
async def test_k_run_q_wait_and_one_more_is_refused_with_retry_after() -> None:
    q = StartQueue(max_starts=2, queue=2, wait=600)
    s = Starts(q)
    s.start("a"), s.start("b")
    await until(lambda: len(s.order) == 2)
    s.start("c"), s.start("d")
    await until(lambda: q.waiting == 2)
    assert q.running == 2 and s.order == ["a", "b"]
    with pytest.raises(Busy) as refused:
        async with q.slot():
            raise AssertionError("a fifth start ran")
    assert "busy starting sandboxes" in refused.value.message
    assert 1 <= refused.value.retry_after <= 60
    assert refused.value.headers() == {"Should-Retry": "true", "Retry-After": str(refused.value.retry_after)}
    assert q.figures()["refused"] == 1
    for name in "abcd":
        await s.let_go(name)
    assert s.order == ["a", "b", "c", "d"] and q.running == 0 and q.waiting == 0


async def test_waiters_get_slots_first_come_first_served() -> None:
    q = StartQueue(max_starts=1, queue=10, wait=600)
    s = Starts(q)
    names = ["first", "second", "third", "fourth", "fifth"]
    s.start(names[0])
    await until(lambda: s.order == ["first"])
    for n, name in enumerate(names[1:], start=1):
        s.start(name)
        await until(lambda n=n: q.waiting == n)  # type: ignore[misc]
    for name in names:
        await s.let_go(name)
    assert s.order == names


async def test_a_start_that_waits_longer_than_w_is_refused_and_leaves_the_line() -> None:
    q = StartQueue(max_starts=1, queue=4, wait=0.01)
    s = Starts(q)
    s.start("holder")
    await until(lambda: s.order == ["holder"])
    with pytest.raises(Busy):
        async with q.slot():
            raise AssertionError("ran without a slot")
    assert q.waiting == 0 and q.running == 1
    await s.let_go("holder")
    assert q.running == 0
    async with q.slot():  # the slot it gave up is not lost
        assert q.running == 1


async def test_refills_wait_behind_every_user_start() -> None:
    q = StartQueue(max_starts=1, queue=0, wait=600)  # no room in the users' line: refills are never refused
    s = Starts(q)
    s.start("refill-alone", refill=True)  # a free slot and nobody waiting: a refill runs at once
    await until(lambda: s.order == ["refill-alone"])
    await s.let_go("refill-alone")

    q = StartQueue(max_starts=1, queue=4, wait=600)
    s = Starts(q)
    s.start("user-1")
    await until(lambda: s.order == ["user-1"])
    s.start("refill-1", refill=True)
    s.start("refill-2", refill=True)
    await until(lambda: q.figures()["refillsWaiting"] == 2)
    s.start("user-2")  # came after the refills, goes before them
    s.start("user-3")
    await until(lambda: q.waiting == 2)
    for name in ("user-1", "user-2", "user-3", "refill-1", "refill-2"):
        await until(lambda name=name: name in s.order)  # type: ignore[misc]
        await s.let_go(name)
    assert s.order == ["user-1", "user-2", "user-3", "refill-1", "refill-2"]


async def test_a_cancelled_waiter_leaves_the_line_and_close_ends_the_refills() -> None:
    q = StartQueue(max_starts=1, queue=4, wait=600)
    s = Starts(q)
    s.start("holder")
    await until(lambda: s.order == ["holder"])
    gone = s.start("gone")
    s.start("next")
    await until(lambda: q.waiting == 2)
    gone.cancel()
    await until(lambda: q.waiting == 1)
    await s.let_go("holder")
    await until(lambda: s.order == ["holder", "next"])
    refill = s.start("refill", refill=True)
    await until(lambda: q.figures()["refillsWaiting"] == 1)
    q.close()
    with pytest.raises(Unavailable):
        await refill
    await s.let_go("next")
    assert q.running == 0


async def test_retry_after_grows_with_the_line() -> None:
    q = StartQueue(max_starts=1, queue=8, wait=600)
    s = Starts(q)
    s.start("holder")
    await until(lambda: s.order == ["holder"])
    before = q.retry_after()
    s.start("waiter")
    await until(lambda: q.waiting == 1)
    assert 1 <= before < q.retry_after() <= 60
    await s.let_go("holder")
    await s.let_go("waiter")


# -- limits, over HTTP ---------------------------------------------------------------------------------------
async def create(s: Served, **body: Any) -> tuple[int, Any, dict[str, str]]:
    async with s.http.post(s.url + "/sandboxes", json={"templateID": "base", "timeout": 120, **body},
                           headers=s.headers) as r:
        return r.status, await r.json(), dict(r.headers)


def is_error(status: int, body: Any, *words: str) -> bool:
    return (isinstance(body, dict) and body.get("code") == status and isinstance(body.get("message"), str)
            and all(w in body["message"] for w in words))


def slow(runtime: FakeRuntime) -> FakeRuntime:
    runtime.delay["create"] = runtime.delay["restore"] = 0.05  # the creates overlap: the limits are raced
    return runtime


async def test_a_busy_host_answers_503_with_retry_after() -> None:
    async with serving("fake", pool_size=0, admission=AdmissionConfig(max_starts=1, start_queue=0)) as s:
        async with s.manager.instances.starts.slot():  # the one start slot is taken
            status, body, headers = await create(s)
        assert status == 503 and is_error(503, body, "busy starting sandboxes", "retry in"), body
        assert headers["Should-Retry"] == "true" and 1 <= int(headers["Retry-After"]) <= 60
        status, health = await s.call("GET", "/health")
        assert health["admission"]["starts"]["refused"] == 1 and health["admission"]["starts"]["limit"] == 1
        status, body, _ = await create(s)
        assert status == 201, body


async def test_the_host_limit_admits_exactly_that_many_and_a_kill_frees_a_place() -> None:
    admission = AdmissionConfig(max_sandboxes=4, max_sandboxes_per_key=0)
    async with serving("fake", runtime=slow(FakeRuntime()), pool_size=0, admission=admission) as s:
        results = await asyncio.gather(*(create(s) for _ in range(9)))
        made = [b["sandboxID"] for st, b, _ in results if st == 201]
        refused = [(st, b, h) for st, b, h in results if st != 201]
        assert len(made) == 4 and len(refused) == 5, [r[:2] for r in results]
        for st, b, h in refused:
            assert st == 503 and is_error(503, b, "limit of 4 sandboxes", "--max-sandboxes"), b
            assert h["Should-Retry"] == "false"
        assert len(s.runtime.statuses()) == 4
        assert (await s.call("DELETE", f"/sandboxes/{made[0]}"))[0] == 204
        assert (await create(s))[0] == 201
        assert (await create(s))[0] == 503


async def test_pooled_sandboxes_count_on_the_host_and_a_claim_needs_no_place() -> None:
    admission = AdmissionConfig(max_sandboxes=2, max_sandboxes_per_key=0)
    async with serving("fake", pool_size=1, admission=admission) as s:
        await until_ready(s, 1)
        status, body, _ = await create(s, memoryMB=256)  # other limits than the pool's: a cold start
        assert status == 201, body
        status, body, _ = await create(s, memoryMB=256)
        assert status == 503 and is_error(503, body, "limit of 2 sandboxes"), body
        status, body, _ = await create(s)  # the warm one, counted already
        assert status == 201, body
        pool = next(iter(s.manager.pools.values()))
        await until(lambda: pool.full)  # its refill finds no room
        assert s.manager.places.on_host() == 2 and len(s.runtime.statuses()) == 2


async def until_ready(s: Served, n: int) -> None:
    for _ in range(2000):
        if sum(len(p) for p in s.manager.pools.values()) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the pool never filled")


async def test_the_per_key_limit_admits_exactly_that_many_under_concurrency() -> None:
    admission = AdmissionConfig(max_sandboxes_per_key=3)
    async with serving("fake", runtime=slow(FakeRuntime()), pool_size=0, admission=admission) as s:
        results = await asyncio.gather(*(create(s) for _ in range(10)))
        assert sum(1 for st, _, _ in results if st == 201) == 3, [r[:2] for r in results]
        for st, b, h in results:
            if st != 201:
                assert st == 429 and is_error(429, b, "API key 'tests'", "limit of 3 running sandboxes",
                                              "3 running"), b
                assert h["Should-Retry"] == "false"


async def test_a_keys_own_limit_wins_over_the_servers() -> None:
    async with serving("fake", pool_size=0, admission=AdmissionConfig(max_sandboxes_per_key=1)) as s:
        key = await find(s.manager.keys, s.key)
        assert key is not None
        assert await s.manager.keys.set_limit(key.id, 3)
        assert [(await create(s))[0] for _ in range(4)] == [201, 201, 201, 429]
        assert await s.manager.keys.set_limit(key.id, 0)  # unlimited
        assert (await create(s))[0] == 201
        other = (await issue(s.manager.keys, "other"))[1]
        async with s.http.post(s.url + "/sandboxes", json={"templateID": "base"}, headers={"X-API-KEY": other}) as r:
            assert r.status == 201  # another key's count is its own
        async with s.http.post(s.url + "/sandboxes", json={"templateID": "base"}, headers={"X-API-KEY": other}) as r:
            body = await r.json()
            assert r.status == 429 and is_error(429, body, "API key 'other'", "limit of 1 running"), body


async def test_paused_sandboxes_do_not_count_and_a_resume_needs_a_place() -> None:
    async with serving("fake", pool_size=0, admission=AdmissionConfig(max_sandboxes_per_key=2)) as s:
        a = (await create(s))[1]["sandboxID"]
        assert (await create(s))[0] == 201
        assert (await create(s))[0] == 429
        assert (await s.call("POST", f"/sandboxes/{a}/pause"))[0] == 204
        status, body, _ = await create(s)
        assert status == 201, body
        status, body = await s.call("POST", f"/sandboxes/{a}/connect", {"timeout": 60})
        assert status == 429 and is_error(429, body, "limit of 2 running"), body
        assert s.manager.get(a).state == State.PAUSED
        assert (await s.call("DELETE", f"/sandboxes/{(await running(s))[0]}"))[0] == 204  # frees a place
        status, body = await s.call("POST", f"/sandboxes/{a}/connect", {"timeout": 60})
        assert status == 201, body


async def running(s: Served) -> list[str]:
    _, listed = await s.call("GET", "/v2/sandboxes?state=running")
    return [x["sandboxID"] for x in listed]


async def test_a_fork_and_a_create_from_a_snapshot_count_all_their_sandboxes() -> None:
    async with serving("fake", runtime=slow(FakeRuntime()), pool_size=0,
                       admission=AdmissionConfig(max_sandboxes_per_key=3)) as s:
        parent = (await create(s))[1]["sandboxID"]
        status, snap = await s.call("POST", f"/sandboxes/{parent}/snapshots", {})
        assert status == 201, snap
        status, body = await s.call("POST", f"/sandboxes/{parent}/fork", {"count": 3})
        assert status == 429 and is_error(429, body, "limit of 3 running", "3 more asked for"), body
        assert await running(s) == [parent]
        # Beside the parent, a fork of 2 and a create from the snapshot do not both fit: exactly one is refused.
        (fork_status, fork_body), (snap_status, snap_body, _) = await asyncio.gather(
            s.call("POST", f"/sandboxes/{parent}/fork", {"count": 2}), create(s, templateID=snap["snapshotID"]))
        assert sorted([fork_status, snap_status]) == [201, 429], (fork_body, snap_body)
        if fork_status == 201:
            assert len(fork_body) == 2 and all("sandbox" in child for child in fork_body), fork_body
            assert is_error(429, snap_body, "limit of 3 running", "another asked for"), snap_body
            assert len(await running(s)) == 3
        else:
            assert is_error(429, fork_body, "2 more asked for"), fork_body
            assert len(await running(s)) == 2
