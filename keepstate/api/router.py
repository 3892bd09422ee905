"""The data-plane router: requests for a sandbox go to the sandbox, streamed both ways.

A request is for a sandbox when it carries `E2b-Sandbox-Id`/`E2b-Sandbox-Port` (what the
SDK sends when E2B_SANDBOX_URL is set), when its Host is `<port>-<sandboxID>.<domain>`, or
when it is a signed `/files` URL (the only header-less data-plane request: it is matched to
the sandbox whose access token produced the signature). Port 49983 is the agent, any other
port is proxied to that port inside the sandbox, WebSockets included.

HTTP goes out through the router's own HTTP/1.1 client and the sandbox's keep-alive pool (sandbox/upstream.py),
WebSockets through aiohttp's; what is relayed how, and what it costs: docs/design/network.md, "Inbound".
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import re
import secrets
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from yarl import URL

from keepstate.agent.resumable import STREAM_HEADER
from keepstate.ports import AGENT_PORT
from keepstate.sandbox.agent_client import InFlight
from keepstate.sandbox.manager import SandboxManager
from keepstate.sandbox.record import SandboxRow
from keepstate.sandbox.upstream import Connection, Head, UpstreamError

from .inbound import TOKEN_HEADER, Inbound
from .relay import pipe

if TYPE_CHECKING:
    from aiohttp.web_urldispatcher import _InfoDict  # AbstractResource.get_info's type

# The cluster's own hop headers (api/relay.py) are the nodes', never the sandbox's.
_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
        "transfer-encoding", "upgrade", "host", "content-length", TOKEN_HEADER, "x-keepstate-relayed",
        "x-keepstate-epoch", STREAM_HEADER}
# Not relayed to the sandbox either: `expect` (the server has answered a 100-continue already).
_HOP_RAW = {h.encode() for h in _HOP} | {b"expect"}
_DEFAULT_PORT = {"http": 80, "https": 443}
BUFFERED_BODY = 1 << 16  # a request body up to this size is read whole before it is relayed (it can be sent twice)
# The agent's streaming RPCs: their requests (a command line and its environment, a watch: a few KiB, never more than
# exec takes) are read whole even when chunked, so that they are resumable like any request held whole.
STREAMING_RPCS = frozenset({"/process.Process/Start", "/process.Process/Connect", "/filesystem.Filesystem/WatchDir"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})  # sent again when a snapshot cut them before their answer
RESUMABLE_BODY = 4 << 20  # a streaming RPC's request is read whole up to this (exec's own limit is 2 MiB): a 413 beyond
HEADERS_WAIT = 0.002  # seconds an answer's headers wait for its first body bytes, to go out with them
log = logging.getLogger("keepstate.router")
SLOW_ANSWER = 10.0  # seconds before a sandbox's answer (its response headers) is logged as slow
CLIENT_CHECK = 1.0  # seconds between checks that a relayed request's client is still there
SERVICE_WAIT = 10.0  # seconds a request waits for a template's service that refuses connections (restarting)
_HOST = re.compile(r"^(\d{1,5})-([a-z0-9]+)\.")
# Paths of the agent that only the host may call: /init, and everything under /keepstate/ (a filesystem-only
# pause's files, the idle look that decides a freeze).
_PRIVATE = {"/init"}
_PRIVATE_PREFIX = "/keepstate/"


def private(path: str) -> bool:
    return path in _PRIVATE or path.startswith(_PRIVATE_PREFIX)


def not_found(sandbox_id: str) -> web.Response:
    return web.json_response({"sandboxId": sandbox_id, "message": "The sandbox was not found", "code": 502},
                             status=502)


def port_closed(sandbox_id: str, port: int, service: str | None = None) -> web.Response:
    """E2B's answer for a port nothing listens on; for a template's service (which should always listen), which one
    did not start and where its log is."""
    message = "The sandbox is running but port is not open"
    body: dict[str, object] = {"sandboxId": sandbox_id, "message": message, "port": port, "code": 502}
    if service is not None:
        body["service"] = service
        body["message"] = (f"{message}: the template's service '{service}' is not listening on it (its log in the "
                           f"sandbox: /var/log/keepstate/{service}.log)")
    return web.json_response(body, status=502)


def tcp_state(address: str, port: int) -> str:
    """The host's view of its TCP connections to a sandbox's port (`ss -tin`: queues, retransmits), for the log
    line about a stalled request. Called only then; it blocks for the few milliseconds `ss` takes."""
    try:
        out = subprocess.run(["ss", "-tinH", "dst", f"{address}:{port}"], capture_output=True, text=True,
                             timeout=2).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"(ss failed: {e})"
    return " | ".join(" ".join(line.split()) for line in out.splitlines()) or "(no connection)"


def target_of(request: web.Request) -> tuple[str, int] | None:
    sid = request.headers.get("E2b-Sandbox-Id")
    if sid:
        try:
            port = int(request.headers.get("E2b-Sandbox-Port", AGENT_PORT))
        except ValueError:
            port = AGENT_PORT
        return sid, port
    m = _HOST.match(request.host or "")
    if m:
        return m.group(2), int(m.group(1))
    return None


def is_data_plane(request: web.Request) -> bool:
    """Whether the request is the router's (app.py's dispatch sends it here): a sandbox named by its headers or Host,
    or a signed /files URL."""
    if target_of(request) is not None:
        return True
    return request.path == "/files" and "signature" in request.query


class DataPlane(web.AbstractResource):
    """What every data-plane request resolves to: the app registers it after the control plane's routes, under "/"
    (the last one looked at). Unresolved, such a request (its path is usually no API route) costs aiohttp an
    HTTPNotFound and a middleware chain built anew per request, before the dispatch middleware sends it to the
    router all the same; resolved here, it takes aiohttp's cached chain. Dispatch still decides: a data-plane
    request whose path is also an API route resolves to that route and is sent to the router too."""

    def __init__(self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> None:
        super().__init__()
        self._route = web.ResourceRoute("*", handler, self)

    @property
    def canonical(self) -> str:
        return "/"

    def url_for(self, **kwargs: str) -> URL:
        raise NotImplementedError("data-plane requests have no URL of ours")

    async def resolve(self, request: web.Request) -> tuple[web.UrlMappingMatchInfo | None, set[str]]:
        if is_data_plane(request):
            return web.UrlMappingMatchInfo({}, self._route), set()
        return None, set()

    def add_prefix(self, prefix: str) -> None:
        raise NotImplementedError("the data plane is not a sub-application's")

    def get_info(self) -> _InfoDict:
        return {"path": "/"}

    def raw_match(self, path: str) -> bool:
        return False

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[web.AbstractRoute]:
        return iter((self._route,))


class _Relayed(web.StreamResponse):
    """A relayed answer whose headers go out with its first body bytes (one write, one wake-up of the client), as
    aiohttp's own `Response` does; `_http` flushes them alone when the body is slow to come (HEADERS_WAIT)."""

    _send_headers_immediately = False


def file_signature(path: str, op: str, user: str, token: str, exp: str | None) -> str:
    raw = f"{path}:{op}:{user}:{token}" + (f":{exp}" if exp else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode().rstrip("=")


class Router:
    """Proxies data-plane requests; every connection into a sandbox is the AgentClient's (its quiesce gate)."""

    def __init__(self, manager: SandboxManager, max_upload: int = 2 << 30) -> None:
        self.manager = manager
        self.agents = manager.agents
        self.max_upload = max_upload
        self.inbound = Inbound(manager)

    async def stop(self) -> None:
        pass  # the AgentClient closes its pools when the manager stops

    def match_signed_file(self, request: web.Request) -> SandboxRow | None:
        sig = request.query.get("signature")
        path = request.query.get("path")
        if request.path != "/files" or not sig or path is None:
            return None
        op = "read" if request.method == "GET" else "write"
        user = request.query.get("username", "")
        exp = request.query.get("signature_expiration")
        for row in self.manager.running():
            if file_signature(path, op, user, row.access_token, exp) == sig:
                return row
        return None

    async def handle(self, request: web.Request, sandbox_id: str, port: int) -> web.StreamResponse:
        await self.agents.admit(sandbox_id)  # a snapshot or fork in progress: wait for it
        row = self.manager.route(sandbox_id)
        if row is None:
            known = self.manager.table.find(sandbox_id)
            refused = self.inbound.refuse(request, known, port) if known is not None else None
            answer = refused or await self.inbound.wake(sandbox_id)  # the token first: no stranger wakes it
            if answer is not None:
                return answer
            await self.agents.admit(sandbox_id)
            row = self.manager.route(sandbox_id)
            if row is None:
                return not_found(sandbox_id)
        refused = self.inbound.refuse(request, row, port)
        if refused is not None:
            return refused
        if port == AGENT_PORT and private(request.path):
            return web.json_response({"code": 403, "message": f"{request.path} is reserved for the host"},
                                     status=403)
        if (port == AGENT_PORT and request.method == "POST" and request.path == "/files"
                and (request.content_length or 0) > self.max_upload):
            return web.json_response(
                {"code": 413, "message": f"upload of {request.content_length} bytes is larger than this server's "
                                         f"limit of {self.max_upload} bytes (keepstate serve --max-upload-mb)"},
                status=413)
        with self.agents.proxying(sandbox_id, request.transport) as flight:
            if request.headers.get("Upgrade", "").lower() == "websocket":
                flight.started = True  # a cut WebSocket is closed, never answered
                return await self._websocket(request, row, port)
            return await self._while_client_stays(request, row, port, flight)

    async def _while_client_stays(self, request: web.Request, row: SandboxRow, port: int,
                                  flight: InFlight) -> web.StreamResponse:
        """Relay until the relay ends or the client goes away. The server does not cancel a handler whose client
        disconnected (a lifecycle call must run to its end), but a relay must not outlive its client: the
        sandbox would stream on to nobody, and a stream the SDK gave up on would end without a word. Cancelled,
        the relay closes its upstream (the sandbox sees the disconnect, as a client's own would be seen) and says
        in the log where a silent stream stalled. The check is a timer every CLIENT_CHECK seconds on this task,
        not a task of its own: most relays end before the first."""
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        gone = False
        timer: list[asyncio.TimerHandle] = []

        def check() -> None:
            nonlocal gone
            if request.transport is None or request.transport.is_closing():
                gone = True
                task.cancel()
            else:
                timer[0] = loop.call_later(CLIENT_CHECK, check)

        timer.append(loop.call_later(CLIENT_CHECK, check))
        try:
            return await self._http(request, row, port, flight)
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()
            return web.Response(status=499)  # nobody reads it: the client is gone
        finally:
            timer[0].cancel()

    async def _http(self, request: web.Request, row: SandboxRow, port: int, flight: InFlight) -> web.StreamResponse:
        scheme, host = self.inbound.upstream(row, port)
        if host is None:
            host = row.address if port == _DEFAULT_PORT[scheme] else f"{row.address}:{port}"
        target = request.raw_path if request.raw_path.startswith("/") else str(request.rel_url)
        head = [f"{request.method} {target} HTTP/1.1\r\nHost: {host}\r\n".encode("utf-8", "surrogateescape")]
        head += [name + b": " + value + b"\r\n" for name, value in request.raw_headers if name.lower() not in _HOP_RAW]
        body, streamed, chunked = b"", False, False
        whole = port == AGENT_PORT and request.method == "POST" and request.path in STREAMING_RPCS
        if request.body_exists:
            length = request.content_length
            if length is not None and length <= BUFFERED_BODY or whole:
                try:
                    body = await _whole(request, RESUMABLE_BODY)  # the request can be sent again if need be
                except (ConnectionError, aiohttp.ClientError):
                    return web.Response(status=499)  # nobody reads it: the client went away mid-body
                except ValueError as e:
                    return web.json_response({"code": 413, "message": str(e)}, status=413)
                head.append(b"Content-Length: %d\r\n" % len(body))
            elif length is not None:
                streamed = True
                head.append(b"Content-Length: %d\r\n" % length)
            else:
                streamed = chunked = True
                head.append(b"Transfer-Encoding: chunked\r\n")
        # A POST into the agent held whole (an RPC, a small upload): the agent keeps its answer for us to pick up
        # again if a snapshot's gate cuts it, so it runs once whatever the cut (docs/design/resumable-streams.md).
        flight.resumable = port == AGENT_PORT and request.method == "POST" and not streamed
        stream = secrets.token_hex(16) if flight.resumable else ""
        if stream:
            head.append(f"{STREAM_HEADER}: {stream}\r\n".encode())
        head.append(b"\r\n")
        request_bytes = b"".join(head) + body
        asked = time.monotonic()
        sender: asyncio.Task[None] | None = None
        conn: Connection | None = None
        refused_until: float | None = None
        try:
            while True:
                if flight.cut and flight.held and not await self._after_gate(row, flight):
                    return not_found(row.sandbox_id)  # cut (reading its body) by a gate after which it is gone
                try:
                    conn = await self.agents.proxy_pool(row.sandbox_id).connect(scheme, row.address, port)
                except OSError:
                    if flight.held and await self._after_gate(row, flight):
                        continue  # nothing was sent: send it now that the snapshot is taken
                    if flight.cut or self.manager.route(row.sandbox_id) is None:
                        return not_found(row.sandbox_id)
                    # A template's service that refuses is (re)starting: its supervisor restarts it with backoff.
                    # Wait for it within a bound rather than answer at once; any other port is answered now.
                    service = self.manager.instances.templates.service_names(row.template_id).get(port)
                    if service is None:
                        return port_closed(row.sandbox_id, port)
                    if refused_until is None:
                        refused_until = time.monotonic() + SERVICE_WAIT
                    if time.monotonic() >= refused_until:
                        log.warning("port %d of sandbox %s (service %s) refused connections for %.0f s", port,
                                    row.sandbox_id, service, SERVICE_WAIT)
                        return port_closed(row.sandbox_id, port, service)
                    await asyncio.sleep(0.1)
                    continue
                except (TimeoutError, UpstreamError):
                    if flight.held and await self._after_gate(row, flight):
                        continue  # nothing was sent: send it now that the snapshot is taken
                    return not_found(row.sandbox_id)
                conn.begin(request.method)
                try:
                    conn.write(request_bytes)
                    if streamed:
                        conn.body_sent = False
                        sender = asyncio.ensure_future(_send_body(request, conn, chunked))
                    answer = await conn.response()
                    if flight.cut:  # the gate cut it just as its answer came: as if before (below)
                        raise UpstreamError("cut by a checkpoint's gate")
                    break
                except UpstreamError:
                    # A reused connection the sandbox had closed, unseen yet: again on another (at worst a new one),
                    # if the request can be sent again. Else the sandbox was killed, paused or checkpointed: a 502.
                    if conn.reused and not streamed and not flight.cut:
                        conn.close()
                        continue
                    if flight.held and not flight.resume and request.method in SAFE_METHODS and not streamed:
                        conn.close()
                        if await self._after_gate(row, flight):
                            continue  # a read cut by a snapshot before its answer: asked again
                        return not_found(row.sandbox_id)
                    try:
                        resumed = await self._resume(row, flight, stream, 0, host) if flight.resume else None
                    except _NeverArrived:
                        conn.close()
                        continue  # the cut came before the agent read it: it never ran, so it is sent now
                    if resumed is None:
                        return not_found(row.sandbox_id)
                    conn, answer = resumed
                    break
        except asyncio.CancelledError:
            # The client gave up waiting (its timeout): say how long the sandbox left it without an answer, the
            # evidence for a stream that never got one.
            if time.monotonic() - asked > SLOW_ANSWER:
                log.warning("%s %s to port %d of sandbox %s: the client went away after %.1f s without the "
                            "sandbox's answer; tcp: %s", request.method, request.path, port, row.sandbox_id,
                            time.monotonic() - asked, tcp_state(row.address, port))
            if conn is not None:
                conn.close()
            if sender is not None:
                sender.cancel()
            raise
        if time.monotonic() - asked > SLOW_ANSWER:
            log.warning("%s %s to port %d of sandbox %s: the sandbox answered after %.1f s", request.method,
                        request.path, port, row.sandbox_id, time.monotonic() - asked)
        released = False
        try:
            if flight.cut:
                return not_found(row.sandbox_id)
            resp = _Relayed(status=answer.status, reason=answer.reason)
            length_given, encoded = None, False
            for k, v in answer.headers:
                lower = k.lower()
                if lower not in _HOP:
                    resp.headers.add(k, v)
                elif lower == "content-length":
                    length_given = v
                elif lower == "transfer-encoding":
                    encoded = True
            if length_given is not None and not encoded:
                resp.content_length = int(length_given)
            flight.started = True
            streamed_bytes, last = 0, time.monotonic()
            try:
                # Servers that send their headers and their body apart (python's http.server) are relayed in one
                # write; a body that takes longer than HEADERS_WAIT (a stream) gets its headers sent first.
                ready = await conn.body_ready(HEADERS_WAIT)
                await resp.prepare(request)
                if not ready:
                    await resp.write(b"")  # the headers, alone
                while True:
                    try:
                        chunk = await conn.chunk()
                    except UpstreamError:
                        try:
                            resumed = await self._resume(row, flight, stream, streamed_bytes, host) \
                                if flight.resume else None
                        except _NeverArrived:
                            resumed = None  # its answer had started: the agent had it; gone since (expired)
                        if resumed is None:
                            raise
                        conn = resumed[0]
                        continue
                    if chunk is None:
                        break
                    streamed_bytes, last = streamed_bytes + len(chunk), time.monotonic()
                    await resp.write(chunk)
            except (asyncio.CancelledError, ConnectionResetError) as gone:
                # The client went away mid-stream. After a long silence from the sandbox, that is the evidence
                # for a stream that stalled: say where its bytes were (the host's TCP view of the connection).
                if time.monotonic() - last > SLOW_ANSWER:
                    log.warning("%s %s to port %d of sandbox %s: the client went away %.1f s into the stream, "
                                "%.1f s after the sandbox's last bytes (%d streamed); tcp: %s", request.method,
                                request.path, port, row.sandbox_id, time.monotonic() - asked,
                                time.monotonic() - last, streamed_bytes, tcp_state(row.address, port))
                if isinstance(gone, asyncio.CancelledError):
                    raise
                return resp  # a write to a client that has gone: nobody to answer
            except UpstreamError:
                # The sandbox went away mid-stream: end the client's connection uncleanly so the
                # SDK sees an interrupted stream, not a stream that ended normally.
                if request.transport is not None:
                    request.transport.close()
                return resp
            try:
                await resp.write_eof()
            except ConnectionResetError:
                return resp  # the client went away just as the answer ended: nobody to answer
            if sender is None or sender.done():
                conn.pool.release(conn)  # a resumed stream's is a later pool's
                released = True
            return resp
        finally:
            if sender is not None:
                sender.cancel()
            if not released:
                conn.close()

    async def _after_gate(self, row: SandboxRow, flight: InFlight) -> bool:
        """Once a snapshot's gate has opened: whether the sandbox still runs here (the flight is in flight again)."""
        await self.agents.admit(row.sandbox_id)
        if self.manager.route(row.sandbox_id) is None:
            return False
        self.agents.rejoin(row.sandbox_id, flight)
        return True

    async def _resume(self, row: SandboxRow, flight: InFlight, stream: str, offset: int,
                      host: str) -> tuple[Connection, Head] | None:
        """Pick a stream cut by a snapshot's gate up again at body byte `offset`, once the gate has opened
        (docs/design/resumable-streams.md). None if it cannot be: the caller cuts its client then, as before."""
        while True:
            if not await self._after_gate(row, flight):
                return None
            conn: Connection | None = None
            token = b"X-Access-Token: %s\r\n" % row.access_token.encode() if row.access_token else b""
            try:
                conn = await self.agents.proxy_pool(row.sandbox_id).connect("http", row.address, AGENT_PORT)
                conn.begin("POST")
                conn.write(b"POST /keepstate/streams/%s?offset=%d HTTP/1.1\r\nHost: %s\r\n%s"
                           b"Content-Length: 0\r\n\r\n" % (stream.encode(), offset, host.encode(), token))
                answer = await conn.response()
            except (OSError, TimeoutError, UpstreamError):
                if conn is not None:
                    conn.close()
                if flight.resume:
                    continue  # cut again, by the next snapshot's gate
                return None
            if answer.status == 404 and offset == 0:
                conn.close()
                raise _NeverArrived()
            if answer.status != 200:
                log.warning("a stream into sandbox %s could not be resumed at byte %d after a checkpoint: %d",
                            row.sandbox_id, offset, answer.status)
                conn.close()
                return None
            log.info("a stream into sandbox %s resumed at byte %d after a checkpoint", row.sandbox_id, offset)
            return conn, answer

    async def _websocket(self, request: web.Request, row: SandboxRow, port: int) -> web.StreamResponse:
        client = self.agents.proxy_session(row.sandbox_id)
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in _HOP and not k.lower().startswith("sec-websocket")}
        protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        scheme, host = self.inbound.upstream(row, port)
        if host is not None:
            headers["Host"] = host
        try:
            upstream = await client.ws_connect(f"{scheme}://{row.address}:{port}{request.rel_url}",
                                               headers=headers, protocols=protocols, ssl=False)
        except aiohttp.ClientConnectorError:
            return port_closed(row.sandbox_id, port)
        except aiohttp.WSServerHandshakeError as exc:
            return web.json_response({"code": exc.status, "message": f"websocket refused: {exc.message}"},
                                     status=exc.status if 400 <= exc.status < 600 else 502)
        ws = web.WebSocketResponse(protocols=[upstream.protocol] if upstream.protocol else ())
        try:
            await ws.prepare(request)
        except BaseException:
            await upstream.close()
            raise
        await pipe(ws, upstream)  # both ways, a close's code and reason included, until both ends are closed
        return ws


class _NeverArrived(Exception):
    """A resume found no stream: the snapshot's cut came before the agent read the request (the gate opens only once
    the sandbox has answered every close, so it has read all it ever will), so it never ran."""


async def _whole(request: web.Request, limit: int) -> bytes:
    parts, size = [], 0
    async for data in request.content.iter_any():
        size += len(data)
        if size > limit:
            raise ValueError(f"{request.path}'s request body is larger than {limit} bytes")
        parts.append(data)
    return b"".join(parts)


async def _send_body(request: web.Request, conn: Connection, chunked: bool) -> None:
    """Stream the client's request body into the sandbox (alongside its answer: both ways at once). A client that goes
    away mid-body closes the upstream connection: the sandbox sees the request cut."""
    try:
        async for data in request.content.iter_any():
            conn.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            await conn.drain()
        if chunked:
            conn.write(b"0\r\n\r\n")
        conn.body_sent = True
    except (UpstreamError, OSError, aiohttp.ClientError, asyncio.IncompleteReadError):
        conn.close()
