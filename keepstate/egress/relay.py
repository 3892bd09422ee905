"""An intercepted connection's HTTP/1.1 exchanges, one at a time: each request of the sandbox parsed and its headers
set (`http1.py`), sent upstream, and its response read back by its framing and forwarded.

Knowing where each response ends is what lets the upstream connection outlive the sandbox's (`pool.py`). The
client's `close` is not sent upstream (Connection is hop-by-hop; the sandbox is told `Connection: close` with the
response instead), and after a complete response the upstream connection is given back (`give_back`) when the
sandbox ends its connection or asked to. It is closed instead after a response delimited by the upstream's close,
an Upgrade or CONNECT (the rest of both connections is spliced), a response that said close, a request body the
upstream answered before it had all of it, an answer of the proxy's own, and any error (then it is reset).

The sandbox's connection lasts no longer than its upstream's: an upstream that ends while the sandbox is between
requests ends the sandbox's connection, as the server's own close would. A request that finds a connection that
has carried a response before (from the pool, or an earlier request) closed before any byte of its answer is sent
once more on a new connection (`reopen`) when it has no body and an idempotent method: the race of a server's
keep-alive timeout with a request, which the client cannot retry itself, for it the connection was new. Otherwise
an upstream that fails a request before its final response is answered with a 502.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from keepstate.egress.http1 import (
    CHUNKED,
    MAX_HEAD,
    TUNNEL,
    UNTIL_CLOSE,
    Answer,
    BadResponse,
    Request,
    copy_body,
    copy_chunked,
    copy_exact,
    parse_head,
    parse_response_head,
    read_head,
)
from keepstate.egress.pipe import CHUNK, Side, both, pump
from keepstate.egress.pool import IDLE_MARGIN_S, Upstream

log = logging.getLogger(__name__)

LINGER_S = 2.0
LINGER_BYTES = 1 << 20
IDEMPOTENT = {"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"}  # RFC 9110 section 9.2.2

Count = Callable[[int], None]
Rewrite = Callable[[Request], Awaitable[None]]  # sets headers on one request; raises Answer to refuse it
Reopen = Callable[[], Awaitable[Upstream]]  # a new connection to the same upstream (dialed, TLS verified)
GiveBack = Callable[[Upstream], None]


class _Unanswered(Exception):
    """The upstream ended or failed before any byte of a response to the request just sent."""


@dataclass
class _Outcome:
    reusable: bool  # the upstream connection may carry another exchange
    keep_client: bool  # the sandbox's connection may carry another request
    tunnel: bool = False  # no longer HTTP: splice the rest


async def relay(client: Side, upstream: Upstream, rewrite: Rewrite, up: Count, down: Count, *, reopen: Reopen,
                give_back: GiveBack) -> None:
    """The sandbox's requests and their responses until either connection ends; the upstream connection is then
    given back, closed, or (on any failure) reset."""
    r = _Relay(client, upstream, rewrite, up, down, reopen)
    again = False
    try:
        try:
            again = await r.run()
        except Answer as a:
            log.info("egress: answered %d: %s", a.status, a.message)  # names a host, header or secret, never a value
            answer = a.response()
            down(len(answer))
            client.writer.write(answer)
            await client.writer.drain()
            r.conn.close()
            await _linger(client)
            return
    except BaseException:
        r.conn.side.reset()
        raise
    if again:
        give_back(r.conn)
    else:
        r.conn.close()


class _Relay:
    def __init__(self, client: Side, conn: Upstream, rewrite: Rewrite, up: Count, down: Count,
                 reopen: Reopen) -> None:
        self.client, self.conn, self.rewrite, self.up, self.down, self.reopen = client, conn, rewrite, up, down, reopen
        self.served = 0

    async def run(self) -> bool:
        """Exchanges until the sandbox ends its connection between requests or asks to close (True: the upstream
        connection may be given back), or either cannot go on (False)."""
        while True:
            head = await self._next_head()
            if head is None:
                return True  # given back only if still usable (the pool checks)
            self.up(len(head))
            head = head.lstrip(b"\r\n")  # empty lines before a request line are ignored (RFC 9112 2.2)
            if not head:
                continue
            req = parse_head(head)
            length = req.framing()  # refuse ambiguous framing before anything goes upstream
            await self.rewrite(req)
            outcome = await self._exchange(req, length)
            self.served += 1
            if outcome.tunnel:
                await both(asyncio.ensure_future(pump(self.client, self.conn.side, self.up)),
                           asyncio.ensure_future(pump(self.conn.side, self.client, self.down)),
                           half_close=not (self.client.tls or self.conn.side.tls))
                return False
            if not outcome.keep_client:
                return outcome.reusable

    async def _next_head(self) -> bytes | None:
        """The sandbox's next request head; None at its EOF, or when the upstream ends while it is between
        requests (after the first: before it, a request finds the upstream gone and reopens it)."""
        if not self.served:
            return await read_head(self.client.reader)
        if not self.conn.usable():
            return None
        gone = asyncio.get_running_loop().create_future()

        def stirred() -> None:
            if not gone.done():
                gone.set_result(None)

        self.conn.protocol.on_activity = stirred
        head = asyncio.ensure_future(read_head(self.client.reader))
        try:
            await asyncio.wait((head, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.conn.protocol.on_activity = None
            gone.cancel()
            if not head.done():
                head.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await head
        return None if head.cancelled() else head.result()

    async def _exchange(self, req: Request, length: int | None) -> _Outcome:
        closes = req.closes
        req.keep_upstream()
        head = req.encode()
        retry = length == 0 and req.method in IDEMPOTENT and not req.upgrade
        if not self.conn.usable():
            await self._replace("it ended while idle")
        while True:
            carried = self.conn.exchanges > 0
            self.conn.side.writer.write(head)
            try:
                if length == 0:
                    return await self._response(req, closes)
                return await self._with_body(req, closes)
            except _Unanswered as e:
                if not (retry and carried):
                    raise Answer(502, f"the upstream {e}") from None
                retry = False
                await self._replace(str(e))

    async def _replace(self, why: str) -> None:
        log.debug("egress: a kept upstream connection is gone (%s): opening another", why)
        self.conn.side.reset()
        self.conn = await self.reopen()

    async def _with_body(self, req: Request, closes: bool) -> _Outcome:
        """The body goes up while the response comes back (an upstream may answer `Expect: 100-continue`, or
        answer early)."""
        body = asyncio.ensure_future(copy_body(req, self.client, self.conn.side, self.up))
        response = asyncio.ensure_future(self._response(req, closes))
        try:
            pending = {body, response}
            while response in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()
            if body in pending:  # answered before the body was all sent: neither connection can go on
                return _Outcome(reusable=False, keep_client=False)
            return response.result()
        finally:
            for t in (body, response):
                if not t.done():
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await t

    async def _response(self, req: Request, closes: bool) -> _Outcome:
        """Read the response (1xx, then the final one) and forward it to the sandbox."""
        conn, received = self.conn, self.conn.protocol.received
        while True:
            try:
                raw = await conn.side.reader.readuntil(b"\r\n\r\n")
            except asyncio.LimitOverrunError:
                raise Answer(502, f"the upstream's response head is larger than {MAX_HEAD} bytes") from None
            except (asyncio.IncompleteReadError, OSError, ssl.SSLError) as e:
                if conn.protocol.received == received:
                    raise _Unanswered(f"closed the connection before answering ({type(e).__name__})") from None
                raise
            conn.got(len(raw))
            try:
                resp = parse_response_head(raw)
                framing = resp.framing(req.method)
            except BadResponse as e:
                raise Answer(502, f"the upstream's response cannot be relayed: {e}") from None
            if 100 <= resp.status < 200 and resp.status != 101:
                if req.version == "HTTP/1.1":  # never to an HTTP/1.0 client (RFC 9110 section 15.2)
                    self._forward(raw)
                continue
            break
        if framing == TUNNEL:
            self._forward(raw)
            return _Outcome(reusable=False, keep_client=False, tunnel=True)
        reusable = (framing != UNTIL_CLOSE and resp.keeps_alive and req.version == "HTTP/1.1" and not req.upgrade
                    and req.method != "CONNECT")
        keep_client = reusable and not closes
        self._forward(raw if keep_client else resp.closing())

        def count(n: int) -> None:
            conn.got(n)
            self.down(n)

        if framing == CHUNKED:
            await copy_chunked(conn.side, self.client, count)
        elif framing == UNTIL_CLOSE:
            await pump(conn.side, self.client, count)
        elif framing > 0:
            await copy_exact(conn.side, self.client, framing, count)
        await self.client.writer.drain()
        if reusable:
            conn.exchanges += 1
            announced = resp.idle_s
            if announced is not None:
                conn.idle_s = min(conn.idle_s, announced - IDLE_MARGIN_S)
        return _Outcome(reusable, keep_client)

    def _forward(self, head: bytes) -> None:
        self.down(len(head))
        self.client.writer.write(head)


async def _linger(client: Side) -> None:
    """After an answer the proxy made: half-close and read what the client still sends for a moment, so closing
    with unread bytes does not reset the connection before the client has read the answer."""
    if client.writer.can_write_eof():
        client.writer.write_eof()
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(LINGER_S):
            seen = 0
            while seen < LINGER_BYTES and (data := await client.reader.read(CHUNK)):
                seen += len(data)
