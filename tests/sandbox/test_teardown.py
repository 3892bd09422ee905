"""Teardowns on the fake runtime (docs/design/teardown.md): a kill answers before its teardown ends, teardowns run
on their own threads, a failed one is retried, and one a server could not finish is finished by the next."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Callable

from keepstate.testing import FakeRuntime, leftovers

from .conftest import Served, serving
from .test_lifecycle import create


async def until(check: Callable[[], bool | Awaitable[bool]], timeout: float = 30.0) -> None:
    """Wait (bounded) until `check()` holds (awaited when it is a coroutine function's)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        held = check()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def health(s: Served) -> dict[str, object]:
    status, body = await s.call("GET", "/health")
    assert status == 200, body
    return dict(body)


async def test_kill_answers_before_the_teardown_ends() -> None:
    runtime = FakeRuntime()
    async with serving(runtime=runtime, pool_size=0) as s:
        sid, _ = await create(s)
        name = s.manager.records[sid].runtime_name
        gate = runtime.gates["destroy"] = threading.Event()  # every destroy waits until the test lets it go
        try:
            assert (await s.call("DELETE", f"/sandboxes/{sid}"))[0] == 204
            assert (await s.call("GET", f"/sandboxes/{sid}"))[0] == 404
            assert (await health(s))["teardowns"] == 1 and name in runtime.names()  # answered; not torn down yet
            assert [r.runtime_name for r in await s.teardowns()] == [name]
        finally:
            gate.set()  # else a failed assertion leaves the server's stop waiting on the destroy until the timeout
        await until(lambda: s.manager.instances.teardowns.pending() == 0)
        assert (await health(s))["teardowns"] == 0 and await s.teardowns() == []
        assert leftovers(s.home, runtime) == []
    runtime.close()


async def test_teardowns_do_not_hold_up_creates() -> None:
    """Teardowns have threads of their own: with more of them stuck than the default executor has threads, a create
    (which starts its instance on the default executor) still succeeds."""
    runtime = FakeRuntime()
    async with serving(runtime=runtime, pool_size=0) as s:
        sids = [(await create(s))[0] for _ in range(12)]
        gate = runtime.gates["destroy"] = threading.Event()
        for sid in sids:
            assert (await s.call("DELETE", f"/sandboxes/{sid}"))[0] == 204
        await until(lambda: runtime.calls.get("destroy", 0) == 12)  # all twelve stuck in destroy at once
        fresh, _ = await create(s)
        assert (await s.call("GET", f"/sandboxes/{fresh}"))[0] == 200
        gate.set()
        await until(lambda: s.manager.instances.teardowns.pending() == 0)
        assert (await s.call("DELETE", f"/sandboxes/{fresh}"))[0] == 204
        await until(lambda: s.manager.instances.teardowns.pending() == 0)
        assert leftovers(s.home, runtime) == []
    runtime.close()


async def test_a_failed_teardown_is_retried_until_it_finishes() -> None:
    runtime = FakeRuntime()
    async with serving(runtime=runtime, pool_size=0) as s:
        sid, _ = await create(s)
        row = s.manager.records[sid]
        runtime.fail("destroy", times=2)
        assert (await s.call("DELETE", f"/sandboxes/{sid}"))[0] == 204
        async def failed_once() -> bool:
            recorded = await s.teardowns()
            return bool(recorded) and recorded[0].attempts >= 1

        await until(failed_once)
        rec = (await s.teardowns())[0]
        assert rec.runtime_name == row.runtime_name and rec.slot == row.slot and "injected" in rec.last_error
        assert runtime.slots.owner(row.slot) == row.runtime_name  # held until its network is gone
        await until(lambda: s.manager.instances.teardowns.pending() == 0)
        assert runtime.calls["destroy"] == 3 and await s.teardowns() == []
        assert runtime.slots.owner(row.slot) is None and leftovers(s.home, runtime) == []
    runtime.close()


async def test_a_server_started_again_finishes_the_teardowns_of_the_last() -> None:
    runtime = FakeRuntime()
    async with serving(runtime=runtime, pool_size=0, reap_on_exit=False) as first:
        sids = [(await create(first))[0] for _ in range(3)]
        names = sorted(first.manager.records[sid].runtime_name for sid in sids)
        runtime.fail("destroy", times=1000)  # this server never manages
        for sid in sids:
            assert (await first.call("DELETE", f"/sandboxes/{sid}"))[0] == 204
        async def all_failed_once() -> bool:
            recorded = await first.teardowns()
            return len(recorded) == 3 and all(r.attempts >= 1 for r in recorded)

        await until(all_failed_once)
        assert (await health(first))["teardowns"] == 3
        home, key = first.home, first.key
    assert sorted(lo.name for lo in leftovers(home, runtime) if lo.kind == "container") == names
    runtime.heal("destroy")
    async with serving(home=home, runtime=runtime, key=key, pool_size=0) as second:
        await until(lambda: second.manager.instances.teardowns.pending() == 0)
        assert await second.teardowns() == [] and (await health(second))["teardowns"] == 0
        assert leftovers(home, runtime) == []
    runtime.close()
