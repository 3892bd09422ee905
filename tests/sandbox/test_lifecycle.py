"""The lifecycle on the fake runtime: every path of the state machine in milliseconds, failures and crashes included.

The same server code runs on gVisor in tests/sdk and tests/durability; here the runtime is
keepstate.testing.FakeRuntime, whose instances keep their files across checkpoints and keep gVisor's hazards
(frozen instances answer nothing; a checkpoint with a connection open wedges the restored instance).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

import pytest

from keepstate.sandbox import checkpoints
from keepstate.sandbox.instances import handle_of
from keepstate.sandbox.state import State
from keepstate.testing import FakeRuntime

from .conftest import Served, serving
from .test_races import read_file, write_file


async def create(s: Served, **body: object) -> tuple[str, str]:
    status, sbx = await s.call("POST", "/sandboxes", {"templateID": "base", **body})
    assert status == 201, sbx
    return sbx["sandboxID"], sbx["envdAccessToken"]


def fake(s: Served) -> FakeRuntime:
    assert isinstance(s.runtime, FakeRuntime)
    return s.runtime


async def events(s: Served, sid: str) -> list[dict[str, object]]:
    status, body = await s.call("GET", f"/sandboxes/{sid}/events")
    assert status == 200, body
    return list(body["events"])


async def test_resume_from_the_store_when_there_is_no_standby() -> None:
    async with serving(standby_seconds=0) as s:
        sid, token = await create(s)
        await write_file(s, sid, token, "/home/user/a", b"kept")
        assert (await s.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204
        await s.manager.instances.drain()  # the stopped instance is torn down after the pause answered
        row = s.manager.records[sid]
        assert row.state == State.PAUSED and row.settings.standby is None and row.settings.retired is None
        restores = fake(s).calls.get("restore", 0)
        assert (await s.call("POST", f"/sandboxes/{sid}/connect", {"timeout": 60}))[0] == 201
        assert fake(s).calls["restore"] == restores + 1
        assert await read_file(s, sid, token, "/home/user/a") == b"kept"
        resumes = [e for e in await events(s, sid) if e["kind"] == "sandbox.resume"]
        assert [e["data"]["from"] for e in resumes] == ["store"]  # type: ignore[index]
        assert fake(s).violations == []


async def test_resume_from_the_standby_is_a_thaw(served: Served) -> None:
    s = served
    sid, token = await create(s)
    await write_file(s, sid, token, "/home/user/a", b"warm")
    assert (await s.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204
    standby = s.manager.records[sid].settings.standby
    assert standby is not None and s.runtime.state(standby.name) == "paused"
    restores = fake(s).calls.get("restore", 0)
    assert (await s.call("POST", f"/sandboxes/{sid}/connect", {"timeout": 60}))[0] == 201
    assert fake(s).calls.get("restore", 0) == restores and s.manager.records[sid].runtime_name == standby.name
    assert await read_file(s, sid, token, "/home/user/a") == b"warm"
    assert [e["data"]["from"] for e in await events(s, sid) if e["kind"] == "sandbox.resume"] == ["standby"]  # type: ignore[index]


async def test_a_failed_checkpoint_leaves_the_sandbox_running(served: Served) -> None:
    s = served
    sid, token = await create(s)
    await write_file(s, sid, token, "/home/user/a", b"still here")
    fake(s).fail("checkpoint", times=2)  # the capture retries once: both fail
    status, body = await s.call("POST", f"/sandboxes/{sid}/pause")
    assert status == 500 and body["code"] == 500 and "injected failure of checkpoint" in body["message"]
    row = s.manager.records[sid]
    assert row.state == State.RUNNING and s.runtime.state(row.runtime_name) == "running"  # thawed
    assert await read_file(s, sid, token, "/home/user/a") == b"still here"
    kinds = [e["kind"] for e in await events(s, sid)]
    assert "checkpoint.failed" in kinds


async def test_a_kill_during_a_pause_waits_for_it_then_kills(served: Served) -> None:
    s = served
    sid, _ = await create(s)
    name = s.manager.records[sid].runtime_name
    fake(s).delay["checkpoint"] = 0.3
    pause = asyncio.create_task(s.call("POST", f"/sandboxes/{sid}/pause"))
    while s.manager.records[sid].state != State.PAUSING:
        await asyncio.sleep(0.005)
    assert (await s.call("GET", f"/sandboxes/{sid}"))[1]["state"] == "running"  # pausing shows as running
    kill = await s.call("DELETE", f"/sandboxes/{sid}")
    assert (await pause)[0] == 204 and kill[0] == 204
    await s.manager.instances.drain()
    assert (await s.call("GET", f"/sandboxes/{sid}"))[0] == 404
    assert await s.row(sid) is None and sid not in s.manager.records
    assert name not in fake(s).names()  # the instance (frozen as the pause's standby) is gone too


async def test_illegal_commands_are_json_409_and_gone_ones_404(served: Served) -> None:
    s = served
    sid, _ = await create(s)
    assert (await s.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204
    for method, path, body in (("POST", f"/sandboxes/{sid}/pause", None),
                               ("POST", f"/sandboxes/{sid}/snapshots", {}),
                               ("POST", f"/sandboxes/{sid}/fork", {"count": 1}),
                               ("POST", f"/sandboxes/{sid}/timeout", {"timeout": 30})):
        status, err = await s.call(method, path, body)
        assert status == 409 and err["code"] == 409 and sid in err["message"], (path, status, err)
    assert (await s.call("DELETE", f"/sandboxes/{sid}"))[0] == 204
    for method, path, body in (("DELETE", f"/sandboxes/{sid}", None), ("POST", f"/sandboxes/{sid}/pause", None),
                               ("GET", f"/sandboxes/{sid}", None)):
        status, err = await s.call(method, path, body)
        assert status == 404 and err["code"] == 404, (path, status, err)


async def test_auto_pause_at_the_timeout(served: Served) -> None:
    s = served
    sid, token = await create(s, timeout=1, autoPause=True)
    await write_file(s, sid, token, "/home/user/a", b"paused by its timeout")
    deadline = time.monotonic() + 10
    while s.manager.records[sid].state != State.PAUSED:
        assert time.monotonic() < deadline, "not auto-paused"
        await asyncio.sleep(0.05)
    assert (await s.call("POST", f"/sandboxes/{sid}/connect", {"timeout": 60}))[0] == 201
    assert await read_file(s, sid, token, "/home/user/a") == b"paused by its timeout"


async def test_a_dead_instance_is_recorded_killed_once(served: Served) -> None:
    s = served
    sid, _ = await create(s)
    name = s.manager.records[sid].runtime_name
    fake(s).crash(name)
    await asyncio.gather(s.manager.died(sid, name), s.manager.died(sid, name))  # noticed twice at once
    assert (await s.call("GET", f"/sandboxes/{sid}"))[0] == 404
    assert [e["kind"] for e in await events(s, sid)].count("sandbox.kill") == 1


async def test_a_new_server_adopts_running_paused_and_half_paused_sandboxes() -> None:
    runtime = FakeRuntime()
    async with serving(runtime=runtime, reap_on_exit=False) as first:
        running, tok_r = await create(first)
        paused, tok_p = await create(first)
        half, tok_h = await create(first)
        for sid, tok in ((running, tok_r), (paused, tok_p), (half, tok_h)):
            await write_file(first, sid, tok, "/home/user/id", sid.encode())
        assert (await first.call("POST", f"/sandboxes/{paused}/pause"))[0] == 204
        # A pause that froze `half` and then died: the database says PAUSING, the instance is frozen.
        row = first.manager.records[half]
        runtime.freeze(handle_of(row))
        row.state = State.PAUSING
        await first.manager.rows.put(row)
        home, key = first.home, first.key
    async with serving(home=home, runtime=runtime, key=key, reap_on_exit=True) as second:
        for sid in (running, half):
            status, info = await second.call("GET", f"/sandboxes/{sid}")
            assert status == 200 and info["state"] == "running", info
        assert (await second.call("GET", f"/sandboxes/{paused}"))[1]["state"] == "paused"
        assert await read_file(second, running, tok_r, "/home/user/id") == running.encode()
        assert await read_file(second, half, tok_h, "/home/user/id") == half.encode()  # thawed
        assert (await second.call("POST", f"/sandboxes/{paused}/connect", {"timeout": 60}))[0] == 201
        assert second.manager.records[paused].runtime_name  # its standby was adopted and thawed
        assert await read_file(second, paused, tok_p, "/home/user/id") == paused.encode()
    assert runtime.violations == []
    runtime.close()


async def test_the_fake_catches_a_checkpoint_with_a_connection_open(served: Served,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """What gVisor does to a caller that bypasses the AgentClient: the fake does it too, so tests catch it."""
    s = served
    monkeypatch.setattr(checkpoints, "RESTORED_AGENT_TIMEOUT", 0.5)
    sid, _ = await create(s)
    row = s.manager.records[sid]
    stray = socket.create_connection((row.address, 49983))  # an idle keep-alive nobody closed
    try:
        while not fake(s).agent(row.runtime_name).open_connections():  # until the agent has accepted it
            await asyncio.sleep(0.005)
        status, forks = await s.call("POST", f"/sandboxes/{sid}/fork", {"count": 1, "timeout": 30})
    finally:
        stray.close()
    assert fake(s).violations and sid not in fake(s).violations[0] and row.runtime_name in fake(s).violations[0]
    # The restored instance is wedged: its agent never answers, so the fork fails (JSON error in the list).
    assert status == 201 and "error" in forks[0], forks
    fake(s).violations.clear()


async def test_a_request_cut_by_a_kill_before_its_answer_gets_the_routers_json_502(served: Served) -> None:
    """The SDK reads a JSON 502 as "sandbox not running"; a connection closed under it reads as a network error."""
    s = served
    sid, token = await create(s)
    name = s.manager.records[sid].runtime_name
    s.runtime.freeze(handle_of(s.manager.records[sid]))  # its agent answers nothing now: the request hangs
    # A plain HTTP client that never retries (aiohttp's retries a request whose reused connection was closed).
    def get() -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(s.url.removeprefix("http://"), timeout=30)
        conn.request("GET", "/files?path=/etc/hostname", headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token})
        resp = conn.getresponse()
        return resp.status, resp.read()

    request = asyncio.create_task(asyncio.to_thread(get))
    while not any(s.manager.agents._inflight.get(sid, ())):  # noqa: SLF001 - wait until it is in flight
        await asyncio.sleep(0.005)
    assert (await s.call("DELETE", f"/sandboxes/{sid}"))[0] == 204
    status, body = await request
    assert status == 502
    assert json.loads(body) == {"sandboxId": sid, "message": "The sandbox was not found", "code": 502}
    await s.manager.instances.drain()
    assert name not in fake(s).names()


async def test_a_client_that_goes_away_ends_its_relay_and_says_how_long_it_waited(
        served: Served, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The server does not cancel the handler of a client that disconnected; the router must notice on its own,
    or a request into a sandbox that never answers is held open to nobody, and the evidence of the stall is lost."""
    from keepstate.api import router

    monkeypatch.setattr(router, "SLOW_ANSWER", 0.0)  # any wait at all counts as slow here
    monkeypatch.setattr(router, "CLIENT_CHECK", 0.05)
    s = served
    sid, token = await create(s)
    s.runtime.freeze(handle_of(s.manager.records[sid]))  # its agent answers nothing now: the request hangs
    host, port = s.url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)))
    conn.sendall(f"GET /files?path=/etc/hostname HTTP/1.1\r\nHost: {host}\r\nE2b-Sandbox-Id: {sid}\r\n"
                 f"X-Access-Token: {token}\r\n\r\n".encode())
    while not any(s.manager.agents._inflight.get(sid, ())):  # noqa: SLF001 - wait until it is in flight
        await asyncio.sleep(0.005)
    conn.close()
    deadline = time.monotonic() + 10
    while any(s.manager.agents._inflight.get(sid, ())):  # noqa: SLF001
        assert time.monotonic() < deadline, "the relay outlived its client"
        await asyncio.sleep(0.01)
    said = [r.getMessage() for r in caplog.records if r.name == "keepstate.router"]
    assert any(f"of sandbox {sid}: the client went away after" in m and "without the sandbox's answer" in m
               and "tcp: " in m for m in said), said
    s.runtime.thaw(handle_of(s.manager.records[sid]))
    assert (await s.call("DELETE", f"/sandboxes/{sid}"))[0] == 204


async def test_a_new_server_reaps_instances_no_row_knows() -> None:
    """A crash between a restore and the write of its row (a resume, a fork) leaves an instance only the slot
    table names; the next server of that data directory reaps it, and leaves other servers' instances alone."""
    from keepstate.runtime.base import Limits, SandboxSpec, TemplateRoot

    runtime = FakeRuntime()
    async with serving(runtime=runtime, reap_on_exit=False, pool_size=0) as first:
        kept, _ = await create(first)
        home, key = first.home, first.key
    spec = SandboxSpec("ks-stray", TemplateRoot("base", "sha256:fake-base", home), Limits())
    other = SandboxSpec("ks-elses", TemplateRoot("base", "sha256:fake-base", home), Limits())
    elsewhere = home.parent / (home.name + "-other-server")
    elsewhere.mkdir()  # a live server's data directory (it exists): its instances are not orphans
    for s, owner_home in ((spec, str(home)), (other, str(elsewhere))):
        slot = next(n for n in range(100, 200) if runtime.slots.claim(n))
        runtime.slots.record_owner(slot, owner_home, s.name)
        runtime.create(s, slot)
    async with serving(home=home, runtime=runtime, key=key, pool_size=0) as second:
        for _ in range(1500):  # adoption leaves its teardowns to the retry loop (docs/design/teardown.md)
            if not second.manager.instances.teardowns.pending():
                break
            await asyncio.sleep(0.02)
        assert "ks-stray" not in runtime.names() and "ks-stray" not in {n for _, n in runtime.slots.owned(str(home))}
        assert "ks-elses" in runtime.names()  # not this data directory's
        assert (await second.call("GET", f"/sandboxes/{kept}"))[1]["state"] == "running"
    runtime.close()
