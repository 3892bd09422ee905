"""Fork readiness on the fake runtime (docs/design/sandbox-lifecycle.md, "Fork readiness"): a restored instance is
handed out only once the ports its checkpoint recorded accept again; the router waits, within a bound, for a
template's service that refuses, and its 502 then names the service. The same on real gVisor sandboxes under load:
tests/interpreter/test_fork_readiness.py and tests/sdk/test_fork_readiness.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from keepstate.api import router
from keepstate.runtime.base import RuntimeFailure
from keepstate.sandbox import checkpoints
from keepstate.sandbox.durable import listening_ports

from .conftest import Served, serving
from .test_upstream import PORT, PortServer, get, to_port


@pytest.fixture
async def declared(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Served, str]]:
    """A fake server whose `base` template declares a service 'web' on PORT, and a sandbox of it."""
    async with serving() as s:
        monkeypatch.setattr(s.manager.instances.templates, "service_names",
                            lambda name: {PORT: "web"} if name == "base" else {}, raising=False)
        status, sbx = await s.call("POST", "/sandboxes", {"templateID": "base"})
        assert status == 201, sbx
        yield s, sbx["sandboxID"]


async def test_a_declared_service_that_never_listens_is_named_in_the_502(
        declared: tuple[Served, str], monkeypatch: pytest.MonkeyPatch) -> None:
    s, sid = declared
    monkeypatch.setattr(router, "SERVICE_WAIT", 0.3)
    status, body = await get(s, sid, "/")
    assert status == 502
    answer = json.loads(body)
    assert answer["service"] == "web" and answer["port"] == PORT
    assert answer["message"].startswith("The sandbox is running but port is not open")
    assert "'web'" in answer["message"] and "/var/log/keepstate/web.log" in answer["message"]


async def test_the_router_waits_for_a_declared_service_that_comes_up(declared: tuple[Served, str]) -> None:
    s, sid = declared
    port = PortServer()

    async def late() -> None:
        await asyncio.sleep(0.5)  # refused until then: a service restarting
        await port.start(s.manager.records[sid].address)

    starting = asyncio.ensure_future(late())
    try:
        assert await get(s, sid, "/") == (200, b"hello 1")
    finally:
        await starting
        await port.stop()


async def test_an_undeclared_port_is_answered_at_once(declared: tuple[Served, str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    s, sid = declared
    monkeypatch.setattr(router, "SERVICE_WAIT", 60.0)  # would show as a hang if the router waited
    async with s.http.get(s.url + "/", headers=to_port(sid, PORT + 1)) as r:
        assert r.status == 502 and "service" not in await r.json()


async def test_wait_ports_names_the_service_that_did_not_listen(declared: tuple[Served, str]) -> None:
    s, sid = declared
    row = s.manager.records[sid]
    with pytest.raises(RuntimeFailure, match=r"service web \(port 8000\) of .* did not accept"):
        await s.manager.instances.wait_ports(row, [PORT], 0.3)
    with pytest.raises(RuntimeFailure, match=r"^port 8001 of"):
        await s.manager.instances.wait_ports(row, [PORT + 1], 0.3)
    port = PortServer()
    await port.start(row.address)
    try:
        await s.manager.instances.wait_ports(row, [PORT], 5)
    finally:
        await port.stop()


async def test_a_fork_waits_for_the_ports_its_checkpoint_recorded(declared: tuple[Served, str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The ports listening at the fork's checkpoint are in its manifest; a child where one never listens again is
    not handed out (one more restore is tried, then the fork reports which service did not come back). With only
    the agent's port recorded, the child is handed out."""
    s, sid = declared
    monkeypatch.setattr(checkpoints, "RESTORED_PORTS_TIMEOUT", 0.5)
    recorded = [49983, PORT]

    async def listening(sandbox_id: str, address: str, token: str) -> list[int]:
        return recorded

    monkeypatch.setattr(s.manager.agents, "listening", listening)
    restores = s.runtime.calls.get("restore", 0)  # type: ignore[attr-defined]
    status, body = await s.call("POST", f"/sandboxes/{sid}/fork", {"count": 1})
    assert status == 201 and len(body) == 1 and "error" in body[0], body
    assert "service web (port 8000)" in body[0]["error"]["message"], body
    assert s.runtime.calls["restore"] == restores + 2  # type: ignore[attr-defined] # the first and one more
    manifest = s.manager.durable.latest_for_session(s.manager.records[sid].session_id, ("fork",))
    assert manifest is not None and listening_ports(manifest) == recorded

    recorded = [49983]
    status, body = await s.call("POST", f"/sandboxes/{sid}/fork", {"count": 1})
    assert status == 201 and "sandbox" in body[0], body
