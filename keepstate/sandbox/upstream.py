"""The router's HTTP/1.1 connections into a sandbox's ports, and their keep-alive pool: one `SandboxConnections` per
sandbox, which the AgentClient owns (its quiesce gate closes it; docs/design/network.md, "Inbound").

A lean client on purpose: aiohttp's client cost the server's loop about 0.5 ms of CPU per request (its request and
response objects, timers, connector and happy-eyeballs set-up), the largest part of what the router added to a port
URL's request (issue 12). This one writes the head the router gives it, streams bodies both ways with back-pressure,
and parses the answer with httptools (llhttp). What it keeps of aiohttp's behaviour:

- a connection goes back to the pool only after a whole exchange that the sandbox's server agreed to keep alive
  (HTTP/1.1 without `Connection: close`), the request's body sent in full and not a HEAD;
- an idle pooled connection the sandbox closes is dropped when its FIN arrives; one idle for KEEPALIVE seconds is
  closed (a timer per pool);
- `SandboxConnections.close()` closes every connection of the pool, idle or in use: the gate's "no connection open
  into a sandbox being checkpointed" (agent_client.py), and a killed sandbox's cut.

One thing it does that aiohttp does not: on a reused connection it asks the kernel to acknowledge the answer's
segments at once (TCP_QUICKACK, after the request is written). A request sent soon after the previous answer puts
the connection in Linux's delayed-ACK mode, and a sandbox's server that writes its headers and its body in two
sends (python's http.server, many small servers) has its second send held by Nagle until that ACK: 40 ms a
request (benchmarks/network.py measured 44 ms p50 through the router, and straight from a client alike).

A request on a reused connection that fails before any answer may have met a close the pool had not seen yet; the
router sends such a request again, on another connection, when it can replay it (`Connection.reused`).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections import deque
from dataclasses import dataclass
from typing import cast

import httptools

KEEPALIVE = 30.0  # seconds an idle pooled connection may be reused (aiohttp's keepalive_timeout, as before)
CONNECT_TIMEOUT = 5.0
HIGH_WATER = 1 << 18  # body bytes held from the sandbox before its connection stops being read
Key = tuple[str, str, int]  # scheme, address, port


class UpstreamError(Exception):
    """The connection failed, closed before its answer was whole, or the answer was not HTTP."""


@dataclass(frozen=True)
class Head:
    status: int
    reason: str
    headers: list[tuple[str, str]]


_tls: ssl.SSLContext | None = None


def tls_context() -> ssl.SSLContext:
    """TLS into a sandbox (its `httpsPorts`): unverified, a sandbox's certificate is its own."""
    global _tls
    if _tls is None:
        _tls = ssl.create_default_context()
        _tls.check_hostname = False
        _tls.verify_mode = ssl.CERT_NONE
    return _tls


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


class Connection(asyncio.Protocol):
    """One connection into a sandbox's port; one exchange at a time (`begin`, `write`, `response`, `chunk`)."""

    def __init__(self, pool: SandboxConnections, key: Key) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.reused = False  # the current exchange runs on a connection taken from the pool
        self._quickack = False  # set TCP_QUICKACK after the next write (a reused connection's request)
        self.idle_since = 0.0
        self.body_sent = True  # the current request's body has been written whole
        self._parser: httptools.HttpResponseParser | None = None
        self._head: Head | None = None
        self._reason = b""
        self._headers: list[tuple[str, str]] = []
        self._head_only = False  # a HEAD: no body follows whatever its headers say
        self._until_eof = False  # a body without length or chunks: it ends when the connection does
        self._complete = False
        self._keep_alive = False  # the server's word, at the end of its answer (llhttp forgets it after)
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused_reading = False
        self._error: str | None = None
        self._closed = False
        self._waiter: asyncio.Future[None] | None = None
        self._drain: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one without subclassing it

    def data_received(self, data: bytes) -> None:
        if self._parser is None or self._complete:  # an idle connection has nothing to say: not one to reuse
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"the sandbox's answer is not HTTP/1.1: {exc}")
        except httptools.HttpParserUpgrade:  # a 101 to a request that asked for no upgrade (Upgrade is not relayed)
            self._fail("the sandbox switched protocols unasked")
        if self._buffered > HIGH_WATER and not self._paused_reading and self.transport is not None:
            self._paused_reading = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._ended()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.pool.forget(self)
        self._ended()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def pause_writing(self) -> None:
        if self._drain is None or self._drain.done():
            self._drain = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # -- httptools callbacks ---------------------------------------------------------------------------------------
    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((_text(name), _text(value)))

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            return  # an interim answer (103 Early Hints): the final one follows, on_message_complete resets
        self._head = Head(status, _text(self._reason), self._headers)
        names = {name.lower() for name, _ in self._headers}
        self._until_eof = (not self._head_only and status not in (204, 304) and "content-length" not in names
                           and "transfer-encoding" not in names)
        if self._head_only:
            self._complete = True

    def on_body(self, body: bytes) -> None:
        if self._head_only:
            return  # a HEAD's answer has no body, whatever the server sends
        self._chunks.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        if self._head is None:  # the end of an interim answer
            self._reason, self._headers = b"", []
            return
        assert self._parser is not None
        self._keep_alive = self._parser.should_keep_alive()
        self._complete = True

    # -- the exchange ------------------------------------------------------------------------------------------------
    def begin(self, method: str) -> None:
        """A new exchange on this connection (its request is written next)."""
        self._parser = httptools.HttpResponseParser(self)
        self._head, self._reason, self._headers = None, b"", []
        self._head_only, self._until_eof, self._complete, self._keep_alive = method == "HEAD", False, False, False
        self._chunks.clear()
        self._buffered, self._error = 0, None
        self.body_sent = True
        self._quickack = self.reused

    def write(self, data: bytes) -> None:
        if self._closed or self.transport is None or self.transport.is_closing():
            raise UpstreamError("the connection into the sandbox is closed")
        self.transport.write(data)
        if self._quickack:
            self._quickack = False
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

    async def drain(self) -> None:
        if self._closed:
            raise UpstreamError("the connection into the sandbox is closed")
        if self._drain is not None and not self._drain.done():
            await self._drain

    async def response(self) -> Head:
        """The answer's head, once it has come whole."""
        while self._head is None:
            if self._error is not None:
                raise UpstreamError(self._error)
            await self._wait()
        return self._head

    async def body_ready(self, within: float) -> bool:
        """Whether the answer's first body bytes (or its end) are here, waiting for them at most `within` seconds."""
        if not self._ready():
            timer = asyncio.get_running_loop().call_later(within, self._wake)
            try:
                await self._wait()
            finally:
                timer.cancel()
        return self._ready()

    async def chunk(self) -> bytes | None:
        """The answer's next body bytes; None at its end. UpstreamError when it ends short (the sandbox went away)."""
        while not self._chunks:
            if self._complete:
                return None
            if self._error is not None:
                raise UpstreamError(self._error)
            await self._wait()
        data = self._chunks.popleft()
        self._buffered -= len(data)
        if self._paused_reading and self._buffered < HIGH_WATER // 4 and self.transport is not None:
            self._paused_reading = False
            self.transport.resume_reading()
        return data

    def park(self) -> None:
        """The exchange is over and the connection idle in its pool: whatever it receives now closes it."""
        self.reused, self.idle_since, self._parser = False, time.monotonic(), None

    def reusable(self) -> bool:
        return (self._complete and not self._closed and not self._head_only and not self._until_eof
                and self.body_sent and self._keep_alive)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self._closed = True
        self.pool.forget(self)
        self._ended()

    # -- inside ----------------------------------------------------------------------------------------------------
    def _ended(self) -> None:
        """The sandbox's side has ended: a body that runs until the close is whole, any other answer is cut short."""
        if self._head is not None and self._until_eof and not self._complete and self._error is None:
            self._complete = True
        elif not self._complete:
            self._fail("the sandbox closed the connection before its answer was whole")
        self._wake()

    def _ready(self) -> bool:
        return bool(self._chunks) or self._complete or self._error is not None

    def _fail(self, why: str) -> None:
        if self._error is None:
            self._error = why

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class SandboxConnections:
    """One sandbox's connections: the idle ones by (scheme, address, port), and every open one, so that `close`
    leaves none."""

    def __init__(self) -> None:
        self._idle: dict[Key, list[Connection]] = {}
        self._open: set[Connection] = set()
        self._expiry: asyncio.TimerHandle | None = None
        self.closed = False

    def open_count(self) -> int:
        """Connections open into the sandbox, idle or in use."""
        return len(self._open)

    def idle_count(self) -> int:
        return sum(len(conns) for conns in self._idle.values())

    async def connect(self, scheme: str, address: str, port: int) -> Connection:
        """An idle connection to the port (`reused`), else a new one. OSError or TimeoutError if it cannot connect;
        UpstreamError if the pool was closed meanwhile (the sandbox is being checkpointed or was killed)."""
        if self.closed:
            raise UpstreamError("the sandbox's connections are closed")
        key = (scheme, address, port)
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if now - conn.idle_since <= KEEPALIVE and conn.transport is not None and not conn.transport.is_closing():
                conn.reused = True
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(CONNECT_TIMEOUT):
            _, conn = await loop.create_connection(lambda: Connection(self, key), address, port,
                                                   ssl=tls_context() if scheme == "https" else None)
        if self.closed:
            conn.close()
            raise UpstreamError("the sandbox's connections are closed")
        self._open.add(conn)
        return conn

    def release(self, conn: Connection) -> None:
        """The exchange on `conn` is over: keep it for the next request if it may be reused, else close it."""
        if self.closed or not conn.reusable():
            conn.close()
            return
        conn.park()
        self._idle.setdefault(conn.key, []).append(conn)
        if self._expiry is None:
            self._expiry = asyncio.get_running_loop().call_later(KEEPALIVE, self._expire)

    def _expire(self) -> None:
        """Close the connections idle for KEEPALIVE seconds, as aiohttp's connector did: a sandbox's server may
        hold a thread or a slot for each."""
        self._expiry = None
        now = time.monotonic()
        for conns in list(self._idle.values()):
            for conn in [c for c in conns if now - c.idle_since >= KEEPALIVE]:
                conn.close()
        left = [c.idle_since for conns in self._idle.values() for c in conns]
        if left:
            self._expiry = asyncio.get_running_loop().call_later(min(left) + KEEPALIVE - now, self._expire)

    def forget(self, conn: Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle is not None and conn in idle:
            idle.remove(conn)

    def close(self) -> None:
        """Close every connection, idle or in use; the pool makes no new one after."""
        self.closed = True
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
