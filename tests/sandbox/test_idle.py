"""The idle freezer on the fake runtime (docs/design/idle.md): an idle sandbox is frozen, and whatever reaches it
thaws it first. The fake's frozen instances answer nothing, so a path that forgot to thaw hangs (each call here is
bounded, so it fails instead)."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from keepstate.sandbox import idle, loops
from keepstate.sandbox.instances import handle_of
from keepstate.sandbox.tcp_table import open_tcp
from keepstate.testing import FakeRuntime

from .conftest import Served, serving
from .test_races import read_file, write_file

T = TypeVar("T")
BOUND = 20.0  # seconds any one call or wait here may take before the test fails


@pytest.fixture(autouse=True)
def quick_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(idle, "INTERVAL", 0.05)
    monkeypatch.setattr(idle, "MAX_BACKOFF", 0.2)
    monkeypatch.setattr(idle, "SETTLE_MAX", 0.2)


async def until(predicate: Callable[[], T], what: str) -> T:
    deadline = time.monotonic() + BOUND
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.02)
    return value


async def bounded(call: Awaitable[T]) -> T:
    try:
        return await asyncio.wait_for(call, BOUND)
    except TimeoutError:
        dump_stacks(f"a call still unanswered after {BOUND} s")
        raise


def dump_stacks(why: str) -> None:
    """Every task's and every thread's stack, to stderr (the failure report shows it): where a hang waits."""
    print(f"== {why}: the stacks of every task and thread", file=sys.stderr)
    for task in asyncio.all_tasks():
        print(f"-- {task!r}", file=sys.stderr)
        task.print_stack(limit=12, file=sys.stderr)
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        print(f"-- thread {names.get(ident, ident)}", file=sys.stderr)
        print("".join(traceback.format_stack(frame, limit=12)), file=sys.stderr)


async def create(s: Served) -> tuple[str, str]:
    status, sbx = await bounded(s.call("POST", "/sandboxes", {"templateID": "base", "timeout": 300}))
    assert status == 201, sbx
    return sbx["sandboxID"], sbx["envdAccessToken"]


def fake(s: Served) -> FakeRuntime:
    assert isinstance(s.runtime, FakeRuntime)
    return s.runtime


async def frozen(s: Served, sid: str) -> None:
    await until(lambda: s.manager.idle.frozen(sid), f"sandbox {sid} to be frozen")
    assert fake(s).idle_frozen(handle_of(s.manager.records[sid]))


async def test_an_idle_sandbox_is_frozen_and_a_call_thaws_it() -> None:
    async with serving(freeze_idle_after=0.1) as s:
        sid, token = await create(s)
        await bounded(write_file(s, sid, token, "/home/user/a", b"before"))
        await frozen(s, sid)
        assert await bounded(read_file(s, sid, token, "/home/user/a")) == b"before"
        assert not fake(s).idle_frozen(handle_of(s.manager.records[sid]))
        await frozen(s, sid)  # idle again: frozen again
        await bounded(write_file(s, sid, token, "/home/user/b", b"after"))
        assert await bounded(read_file(s, sid, token, "/home/user/b")) == b"after"
        assert fake(s).violations == []


async def test_polls_neither_wake_a_frozen_sandbox_nor_count_as_activity() -> None:
    async with serving(freeze_idle_after=0.1) as s:
        m = s.manager
        sid, token = await create(s)
        await bounded(write_file(s, sid, token, "/home/user/a", b"x" * 100))
        await frozen(s, sid)
        row = m.records[sid]
        before = m.agents.last_active(sid)
        assert m.recorder.poller is not None
        await bounded(m.recorder.poller.poll_once())
        sample = await bounded(loops.sample_once(m, row, {}, {sid: (100, 1 << 30)}))
        assert sample and sample["diskUsed"] == 100 and sample["memUsed"] > 0  # the last disk figures stand
        assert m.idle.frozen(sid) and fake(s).idle_frozen(handle_of(row))
        assert m.agents.last_active(sid) == before
        # Awake, the same polls reach the agent, and still are not activity.
        m.idle.wake(sid)
        m.idle.after = 3600  # not frozen again meanwhile
        await bounded(m.recorder.poller.poll_once())
        disks: dict[str, tuple[int, int]] = {}
        assert await bounded(loops.sample_once(m, row, {}, disks))
        assert disks[sid][0] == 100  # asked the agent
        assert m.agents.last_active(sid) == before


async def test_a_sandbox_running_a_command_is_never_frozen() -> None:
    async with serving(freeze_idle_after=0.1) as s:
        s.manager.idle.after = 3600  # a new sandbox counts as active from its create: not frozen before its
        sid, token = await create(s)  # command "starts" below, however slow the host
        agent = fake(s).agent(s.manager.records[sid].runtime_name)
        agent.busy = True
        s.manager.idle.after = 0.1
        looks = agent.idle_looks
        await until(lambda: agent.idle_looks >= looks + 3, "the freezer to look at it thrice")
        assert not s.manager.idle.frozen(sid)
        agent.busy = False  # the command ended
        await frozen(s, sid)


async def test_why_a_quiet_sandbox_stays_unfrozen_is_logged_once(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A sandbox quiet for HELD_LOG_S and still not frozen says why at INFO, once per reason, with how long it has
    been quiet (counted from the freezer's first look where nothing ever called it: a pooled sandbox)."""
    monkeypatch.setattr(idle, "HELD_LOG_S", 0.3)
    with caplog.at_level(logging.INFO, logger="keepstate.sandbox.idle"):
        async with serving(freeze_idle_after=3600, pool_size=1) as s:
            pool = await until(lambda: next(iter(s.manager.pools.values()), None), "the base pool")
            row = (await until(lambda: pool.ready(), "a pooled sandbox"))[0]
            agent = fake(s).agent(row.runtime_name)
            agent.busy = True
            s.manager.agents._active.pop(row.sandbox_id, None)  # noqa: SLF001 - as for one never called by its ID
            started = time.monotonic()
            s.manager.idle.after = 0.1
            looks = agent.idle_looks
            await until(lambda: agent.idle_looks >= looks + 8, "the freezer to look at it many times")
            told = [r.getMessage() for r in caplog.records if row.sandbox_id in r.getMessage()]
            assert s.manager.idle.held_back(row.sandbox_id) == "its agent says it is not idle: a command runs"
            assert len(told) == 1 and told[0].endswith("is not frozen: its agent says it is not idle: a command runs")
            quiet = re.search(r"quiet for (\d+) s", told[0])
            assert quiet is not None and int(quiet[1]) <= time.monotonic() - started + 1, told[0]


async def test_an_open_connection_into_a_sandbox_keeps_it_awake() -> None:
    async with serving(freeze_idle_after=0.1) as s:
        sid, _ = await create(s)
        row = s.manager.records[sid]
        agent = fake(s).agent(row.runtime_name)
        stray = socket.create_connection((row.address, 49983))  # a connection the freezer knows nothing of
        try:
            looks = agent.idle_looks
            await until(lambda: agent.idle_looks >= looks + 3, "the freezer to look at it thrice")
            assert not s.manager.idle.frozen(sid)
            assert "the host holds TCP connections to it (states ['01'])" == s.manager.idle.held_back(sid)
        finally:
            stray.close()
        await frozen(s, sid)
        assert s.manager.idle.held_back(sid) is None


async def test_connections_still_closing_are_waited_for_not_looked_at_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The connections the freezer closes before a freeze take the sandbox a moment to close (on a loaded host, more
    than one SETTLE): the look waits for them instead of sending the sandbox round again, whose next look would
    open and close a connection of its own and wait for that in turn."""
    monkeypatch.setattr(idle, "SETTLE_MAX", 30.0)
    reads: list[list[str]] = []
    closing = iter([["05"], ["05"], ["05"]])  # FIN_WAIT2: the sandbox has not answered our FIN yet, thrice

    def host_tcp_open(address: str) -> list[str]:
        reads.append(next(closing, []))
        return reads[-1]

    async with serving(freeze_idle_after=0.1) as s:
        sid, _ = await create(s)
        agent = fake(s).agent(s.manager.records[sid].runtime_name)
        monkeypatch.setattr(idle, "host_tcp_open", host_tcp_open)
        looks = agent.idle_looks
        await frozen(s, sid)
        assert agent.idle_looks == looks + 1  # one look, then the freeze
        assert reads[:4] == [["05"], ["05"], ["05"], []]


async def test_a_pooled_sandbox_is_frozen_and_thawed_when_taken() -> None:
    async with serving(freeze_idle_after=0.1, pool_size=1) as s:
        pool = await until(lambda: next(iter(s.manager.pools.values()), None), "the base pool")
        pooled = await until(lambda: pool.ready(), "a pooled sandbox")
        await until(lambda: s.manager.idle.frozen(pooled[0].sandbox_id), "the pooled sandbox to be frozen")
        name = pooled[0].runtime_name
        sid, token = await create(s)
        assert s.manager.records[sid].runtime_name == name  # it got the frozen one
        assert not fake(s).idle_frozen(handle_of(s.manager.records[sid]))
        await bounded(write_file(s, sid, token, "/home/user/a", b"pooled"))
        assert await bounded(read_file(s, sid, token, "/home/user/a")) == b"pooled"


async def test_pause_resume_snapshot_fork_and_kill_of_a_frozen_sandbox() -> None:
    async with serving(freeze_idle_after=0.1) as s:
        sid, token = await create(s)
        await bounded(write_file(s, sid, token, "/home/user/a", b"kept"))
        await frozen(s, sid)
        assert (await bounded(s.call("POST", f"/sandboxes/{sid}/pause")))[0] == 204
        assert (await bounded(s.call("POST", f"/sandboxes/{sid}/connect", {"timeout": 60})))[0] == 201
        assert await bounded(read_file(s, sid, token, "/home/user/a")) == b"kept"
        await frozen(s, sid)
        status, snap = await bounded(s.call("POST", f"/sandboxes/{sid}/snapshots", {}))
        assert status == 201, snap
        await frozen(s, sid)
        status, forks = await bounded(s.call("POST", f"/sandboxes/{sid}/fork", {"count": 1, "timeout": 60}))
        assert status == 201 and "error" not in forks[0], forks
        child, child_token = forks[0]["sandbox"]["sandboxID"], forks[0]["sandbox"]["envdAccessToken"]
        assert await bounded(read_file(s, child, child_token, "/home/user/a")) == b"kept"
        await frozen(s, sid)
        name = s.manager.records[sid].runtime_name
        assert (await bounded(s.call("DELETE", f"/sandboxes/{sid}")))[0] == 204
        await bounded(s.manager.instances.drain())
        assert s.runtime.state(name) == "gone" and not s.manager.idle.frozen(sid)
        assert fake(s).violations == []


async def test_a_new_server_thaws_what_it_adopts() -> None:
    runtime = FakeRuntime()
    async with serving(runtime=runtime, reap_on_exit=False, freeze_idle_after=0) as first:
        sid, token = await create(first)
        await bounded(write_file(first, sid, token, "/home/user/a", b"adopted"))
        runtime.idle_freeze(handle_of(first.manager.records[sid]))  # as a server that died with it frozen
        home, key = first.home, first.key
    async with serving(home=home, runtime=runtime, key=key, freeze_idle_after=0) as second:
        assert await bounded(read_file(second, sid, token, "/home/user/a")) == b"adopted"
    runtime.close()


async def test_freeze_idle_after_0_never_freezes() -> None:
    async with serving(freeze_idle_after=0) as s:
        sid, _ = await create(s)
        assert not s.manager.idle.enabled
        assert not [t for t in s.manager._tasks if t.get_name() == "idle-freezer"]
        assert fake(s).agent(s.manager.records[sid].runtime_name).idle_looks == 0


async def test_the_router_keeps_the_idle_look_to_the_host(served: Served) -> None:
    s = served
    sid, token = await create(s)
    async with s.http.get(f"{s.url}/keepstate/idle", headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token}) as r:
        assert r.status == 403
        body: Any = await r.json()
        assert body["code"] == 403 and "/keepstate/idle" in body["message"]


def test_open_tcp_reads_the_hosts_tables() -> None:
    tcp = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0100007F:0BB8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1\n"
        "   1: 0100580A:9C40 0200580A:C2DF 01 00000000:00000000 00:00000000 00000000     0        0 2\n"
        "   2: 0100580A:9C41 0200580A:C2DF 06 00000000:00000000 00:00000000 00000000     0        0 3\n"
        "   3: 0500580A:9C42 0600580A:C2DF 04 00000000:00000000 00:00000000 00000000     0        0 4\n"
    )
    tcp6 = (
        "  sl  local_address                         remote_address                        st\n"
        "   0: 0000000000000000FFFF00000100580A:1F90 0000000000000000FFFF00000200580A:C350 08 0\n"
    )
    assert open_tcp("10.88.0.2", [tcp, tcp6]) == ["01", "08"]  # the TIME_WAIT one is no obstacle
    assert open_tcp("10.88.0.6", [tcp]) == ["04"]  # FIN_WAIT1: our FIN unanswered
    assert open_tcp("10.88.0.10", [tcp, tcp6]) == []
