"""The router's connections into a sandbox (keepstate/sandbox/upstream.py), on the fake runtime: keep-alive reuse,
the pool closed before a checkpoint and gone with a killed sandbox, a stale pooled connection retried, and the HTTP
the relay must pass through unchanged (chunked and long bodies both ways, close-delimited answers, HEAD, answers cut
short, a closed port's JSON 502), and WebSockets (still aiohttp's, cut by a kill).

A sandbox's own port is served here by a small asyncio server on the fake instance's address (`PortServer`): it
records each request as it arrived and answers as the test scripts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from keepstate.api import router
from keepstate.sandbox import upstream
from keepstate.sandbox.upstream import SandboxConnections
from keepstate.testing import FakeRuntime

from .conftest import Served

PORT = 8000


@dataclass
class Seen:
    """One request as the sandbox's server received it."""

    connection: int  # which connection (1, 2, ...) it came on
    head: list[str]  # request line and header lines
    body: bytes

    def header(self, name: str) -> str | None:
        for line in self.head[1:]:
            k, _, v = line.partition(":")
            if k.strip().lower() == name.lower():
                return v.strip()
        return None


Answer = Callable[["Seen", asyncio.StreamWriter], Awaitable[bool]]  # writes the answer; False: close after


async def ok(seen: Seen, w: asyncio.StreamWriter) -> bool:
    body = f"hello {seen.connection}".encode()
    w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-Seen: yes\r\n\r\n%s" % (len(body), body))
    return True


@dataclass
class PortServer:
    answer: Answer = ok
    seen: list[Seen] = field(default_factory=list)
    connections: int = 0
    server: asyncio.Server | None = None

    async def start(self, address: str) -> None:
        self.server = await asyncio.start_server(self._serve, address, PORT)

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while True:
                try:
                    head = (await r.readuntil(b"\r\n\r\n")).decode().split("\r\n")[:-2]
                except asyncio.IncompleteReadError:
                    return
                seen = Seen(number, head, b"")
                if seen.header("transfer-encoding") == "chunked":
                    while size := int((await r.readline()).strip(), 16):
                        seen.body += await r.readexactly(size)
                        await r.readline()
                    await r.readline()
                else:
                    seen.body = await r.readexactly(int(seen.header("content-length") or 0))
                self.seen.append(seen)
                if not await self.answer(seen, w):
                    return
                await w.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            w.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def sandbox(served: Served) -> AsyncIterator[tuple[Served, str, PortServer]]:
    status, sbx = await served.call("POST", "/sandboxes", {"templateID": "base"})
    assert status == 201, sbx
    sid = sbx["sandboxID"]
    port = PortServer()
    await port.start(served.manager.records[sid].address)
    try:
        yield served, sid, port
    finally:
        await port.stop()


def to_port(sid: str, port: int = PORT) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port)}


def pool_of(s: Served, sid: str) -> SandboxConnections:
    return s.manager.agents._pools[sid]  # noqa: SLF001 - what the gate closes


async def relays_done(s: Served, sid: str) -> None:
    """Until the router's relays into the sandbox have ended (a client has its answer a moment before the relay
    hands its connection back to the pool)."""
    for _ in range(1000):
        if not s.manager.agents.busy(sid):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("a relay did not end")


async def get(s: Served, sid: str, path: str = "/", method: str = "GET", **kw: object) -> tuple[int, bytes]:
    # A client connection of its own each time: the client's keep-alive is not what is tested.
    async with aiohttp.ClientSession() as http, \
            http.request(method, s.url + path, headers=to_port(sid), **kw) as r:  # type: ignore[arg-type]
        return r.status, await r.read()


async def test_connections_are_kept_alive_and_reused(sandbox: tuple[Served, str, PortServer]) -> None:
    s, sid, port = sandbox
    for _ in range(3):
        assert await get(s, sid, "/a?b=c") == (200, b"hello 1")
        await relays_done(s, sid)
    assert port.connections == 1
    assert [x.head[0] for x in port.seen] == ["GET /a?b=c HTTP/1.1"] * 3
    assert pool_of(s, sid).idle_count() == 1


async def test_a_pooled_connection_is_closed_before_a_checkpoint(served: Served) -> None:
    """The agent's own port: the fake runtime records a checkpoint taken with a connection open into the agent (what
    wedges gVisor), so a pooled connection the gate left open fails this test."""
    s = served
    status, sbx = await s.call("POST", "/sandboxes", {"templateID": "base"})
    assert status == 201, sbx
    sid, token = sbx["sandboxID"], sbx["envdAccessToken"]
    headers = {"E2b-Sandbox-Id": sid, "X-Access-Token": token}
    for _ in range(2):
        async with s.http.get(f"{s.url}/files", params={"path": "/nope"}, headers=headers) as r:
            assert r.status == 404 and b"does not exist" in await r.read()  # the agent's answer, relayed
    pool = pool_of(s, sid)
    await relays_done(s, sid)
    assert pool.idle_count() == 1
    status, forks = await s.call("POST", f"/sandboxes/{sid}/fork", {"count": 1, "timeout": 30})  # hold: runs on
    assert status == 201 and "sandbox" in forks[0], forks
    assert pool.closed and pool.open_count() == 0
    async with s.http.get(f"{s.url}/files", params={"path": "/nope"}, headers=headers) as r:
        assert r.status == 404 and await r.read()  # a new pool after the gate opened again
    assert (await s.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204
    assert isinstance(s.runtime, FakeRuntime) and s.runtime.violations == []
    assert not s.manager.agents.has_pool(sid)


async def test_a_killed_sandboxs_pool_is_gone(sandbox: tuple[Served, str, PortServer]) -> None:
    s, sid, port = sandbox
    assert (await get(s, sid))[0] == 200
    await relays_done(s, sid)
    pool = pool_of(s, sid)
    assert pool.open_count() == 1
    assert (await s.call("DELETE", f"/sandboxes/{sid}"))[0] == 204
    assert pool.closed and pool.open_count() == 0
    assert sid not in s.manager.agents._pools  # noqa: SLF001
    assert not s.manager.agents.has_pool(sid)


async def test_an_idle_connection_the_sandbox_closes_is_dropped(sandbox: tuple[Served, str, PortServer]) -> None:
    s, sid, port = sandbox

    async def close_after(seen: Seen, w: asyncio.StreamWriter) -> bool:
        await ok(seen, w)
        await w.drain()
        return False  # then the server closes the kept-alive connection, unasked

    port.answer = close_after
    assert await get(s, sid) == (200, b"hello 1")
    pool = pool_of(s, sid)
    for _ in range(200):  # until the loop has read the FIN (no timing: the count says when)
        if pool.open_count() == 0:
            break
        await asyncio.sleep(0.01)
    assert pool.open_count() == 0 and pool.idle_count() == 0
    assert await get(s, sid) == (200, b"hello 2")


async def test_idle_connections_are_closed_after_the_keepalive(sandbox: tuple[Served, str, PortServer],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    s, sid, port = sandbox
    monkeypatch.setattr(upstream, "KEEPALIVE", 0.05)
    assert await get(s, sid) == (200, b"hello 1")
    await relays_done(s, sid)
    pool = pool_of(s, sid)
    assert pool.idle_count() == 1
    for _ in range(400):  # until the pool's timer has run (the count says when)
        if pool.open_count() == 0:
            break
        await asyncio.sleep(0.01)
    assert pool.open_count() == 0 and pool.idle_count() == 0 and not pool.closed
    assert await get(s, sid) == (200, b"hello 2")


async def test_a_request_a_stale_connection_failed_is_sent_again(sandbox: tuple[Served, str, PortServer]) -> None:
    """The race a pool cannot see: the sandbox closes a kept-alive connection as the next request goes out on it."""
    s, sid, port = sandbox

    async def once_per_connection(seen: Seen, w: asyncio.StreamWriter) -> bool:
        if sum(x.connection == seen.connection for x in port.seen) > 1:
            return False  # closes without an answer
        return await ok(seen, w)

    port.answer = once_per_connection
    assert await get(s, sid) == (200, b"hello 1")
    await relays_done(s, sid)
    assert await get(s, sid, method="POST", data=b"small") == (200, b"hello 2")  # replayed: held whole
    assert [x.body for x in port.seen[1:]] == [b"small", b"small"]
    await relays_done(s, sid)
    big = b"x" * (1 << 17)  # streamed: cannot be sent twice
    status, body = await get(s, sid, method="POST", data=big)
    assert status == 502 and json.loads(body)["sandboxId"] == sid


async def test_bodies_pass_through_both_ways(sandbox: tuple[Served, str, PortServer]) -> None:
    s, sid, port = sandbox

    async def echo(seen: Seen, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 201 Made\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(seen.body), 7000):
            part = seen.body[i:i + 7000]
            w.write(b"%x\r\n%s\r\n" % (len(part), part))
        w.write(b"0\r\n\r\n")
        return True

    port.answer = echo

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(50):
            yield bytes([i]) * 5000

    sent = b"".join(bytes([i]) * 5000 for i in range(50))
    async with aiohttp.ClientSession() as http:
        async with http.post(s.url + "/up", data=chunks(), headers=to_port(sid)) as r:
            assert (r.status, r.reason) == (201, "Made")
            assert await r.read() == sent
        await relays_done(s, sid)
        async with http.put(s.url + "/up", data=sent, headers=to_port(sid)) as r:  # > BUFFERED_BODY: streamed
            assert r.status == 201 and await r.read() == sent
            await relays_done(s, sid)
    assert port.seen[0].header("transfer-encoding") == "chunked" and port.seen[0].body == sent
    assert port.seen[1].header("content-length") == str(len(sent)) and port.seen[1].body == sent
    assert port.connections == 1  # both exchanges whole: the connection was kept


async def test_headers_go_ahead_of_a_slow_body(sandbox: tuple[Served, str, PortServer]) -> None:
    """A stream (server-sent events, a Connect stream): the client has the headers before the first body bytes."""
    s, sid, port = sandbox
    go = asyncio.Event()

    async def slow(seen: Seen, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n")
        await w.drain()
        await go.wait()
        w.write(b"5\r\nlater\r\n0\r\n\r\n")
        return True

    port.answer = slow
    async with aiohttp.ClientSession() as http, http.get(s.url + "/events", headers=to_port(sid)) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"  # the body is not sent yet
        go.set()
        assert await r.read() == b"later"


async def test_close_delimited_head_and_cut_answers(sandbox: tuple[Served, str, PortServer]) -> None:
    s, sid, port = sandbox

    async def answer(seen: Seen, w: asyncio.StreamWriter) -> bool:
        path = seen.head[0].split()[1]
        if path == "/old":  # HTTP/1.0 style: the body ends with the connection
            w.write(b"HTTP/1.0 200 OK\r\n\r\n" + b"y" * 100_000)
            return False
        if path == "/cut":  # says 1000 bytes, sends 10, goes away
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n0123456789")
            return False
        body = b"" if seen.head[0].startswith("HEAD") else b"12345"
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n" + body)
        return True

    port.answer = answer
    assert await get(s, sid, "/old") == (200, b"y" * 100_000)
    async with aiohttp.ClientSession() as http:
        async with http.head(s.url + "/h", headers=to_port(sid)) as r:
            assert r.status == 200 and r.headers["Content-Length"] == "5" and await r.read() == b""
        async with http.get(s.url + "/cut", headers=to_port(sid)) as r:
            assert r.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()  # an interrupted stream, not one that ended normally
    assert await get(s, sid, "/h") == (200, b"12345")
    await relays_done(s, sid)
    assert pool_of(s, sid).open_count() == 1  # only the last one may be kept: the HEAD's was not


async def test_a_client_gone_as_the_answer_ends_is_not_a_server_error(
        sandbox: tuple[Served, str, PortServer], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A client that goes away exactly as the relayed answer ends (the router's last write, its end) is gone like
    one gone mid-stream: no "Error handling request" from aiohttp, and the router serves on."""
    s, sid, port = sandbox
    raised: list[BaseException] = []

    async def chunked(seen: Seen, w: asyncio.StreamWriter) -> bool:  # its end is a write of its own (0 CRLF CRLF)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
        return True

    async def write_eof(self: web.StreamResponse, data: bytes = b"") -> None:
        if not raised and self._req is not None and self._req.transport is not None:  # noqa: SLF001
            self._req.transport.close()  # noqa: SLF001 - the client's connection, gone at this moment
            try:
                await web.StreamResponse.write_eof(self, data)
            except BaseException as exc:
                raised.append(exc)
                raise
        await web.StreamResponse.write_eof(self, data)

    port.answer = chunked
    monkeypatch.setattr(router._Relayed, "write_eof", write_eof)  # noqa: SLF001
    with caplog.at_level(logging.DEBUG, logger="aiohttp"):
        with contextlib.suppress(aiohttp.ClientError):  # the body may have reached it before its connection went
            await get(s, sid, "/")
        assert raised and isinstance(raised[0], ConnectionResetError)  # the moment this test is about
        assert await get(s, sid, "/") == (200, b"hello")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_what_the_sandbox_sees_and_a_closed_port(sandbox: tuple[Served, str, PortServer]) -> None:
    s, sid, port = sandbox
    async with aiohttp.ClientSession() as http:
        async with http.get(s.url + "/p%2Fq?x=%20", headers={**to_port(sid), "X-Mine": "1",
                                                              "Expect": "100-continue"}) as r:
            assert r.status == 200 and r.headers["X-Seen"] == "yes"
        seen = port.seen[-1]
        assert seen.head[0] == "GET /p%2Fq?x=%20 HTTP/1.1"  # the target as the client sent it
        address = s.manager.records[sid].address
        assert seen.header("host") == f"{address}:{PORT}" and seen.header("x-mine") == "1"
        assert seen.header("expect") is None and seen.header("e2b-sandbox-id") == sid
        async with http.get(s.url + "/", headers=to_port(sid, PORT + 1)) as r:
            assert r.status == 502
            assert await r.json() == {"sandboxId": sid, "message": "The sandbox is running but port is not open",
                                      "port": PORT + 1, "code": 502}


async def test_websockets_are_relayed_and_cut_by_a_kill(served: Served) -> None:
    s = served
    status, sbx = await s.call("POST", "/sandboxes", {"templateID": "base"})
    assert status == 201, sbx
    sid = sbx["sandboxID"]

    async def echo(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(protocols=("chat",))
        await ws.prepare(request)
        async for msg in ws:
            await ws.send_str(f"echo {msg.data}")
        return ws

    app = web.Application()
    app.router.add_get("/ws", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, s.manager.records[sid].address, PORT).start()
    try:
        async with aiohttp.ClientSession() as http, \
                http.ws_connect(s.url + "/ws", headers=to_port(sid), protocols=("chat",)) as ws:
            assert ws.protocol == "chat"
            await ws.send_str("hi")
            assert (await ws.receive()).data == "echo hi"
            assert (await s.call("DELETE", f"/sandboxes/{sid}"))[0] == 204
            assert (await ws.receive()).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    finally:
        await runner.cleanup()
