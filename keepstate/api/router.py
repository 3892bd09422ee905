"""The data-plane router: requests for a sandbox go to the sandbox, streamed both ways.

A request is for a sandbox when it carries `E2b-Sandbox-Id`/`E2b-Sandbox-Port` (what the
SDK sends when E2B_SANDBOX_URL is set), when its Host is `<port>-<sandboxID>.<domain>`, or
when it is a signed `/files` URL (the only header-less data-plane request: it is matched to
the sandbox whose access token produced the signature). Port 49983 is the agent, any other
port is proxied to that port inside the sandbox, WebSockets included.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import re
import subprocess
import time
from collections.abc import Awaitable
from typing import Any

import aiohttp
from aiohttp import web

from keepstate.ports import AGENT_PORT
from keepstate.sandbox.agent_client import InFlight
from keepstate.sandbox.manager import SandboxManager
from keepstate.sandbox.record import SandboxRow

from .inbound import TOKEN_HEADER, Inbound

_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
        "transfer-encoding", "upgrade", "host", "content-length", TOKEN_HEADER}
log = logging.getLogger("keepstate.router")
SLOW_ANSWER = 10.0  # seconds before a sandbox's answer (its response headers) is logged as slow
CLIENT_CHECK = 1.0  # seconds between checks that a relayed request's client is still there
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


def port_closed(sandbox_id: str, port: int) -> web.Response:
    return web.json_response({"sandboxId": sandbox_id, "message": "The sandbox is running but port is not open",
                              "port": port, "code": 502}, status=502)


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
            known = self.manager.records.get(sandbox_id)
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
            return await self._while_client_stays(request, self._http(request, row, port, flight))

    async def _while_client_stays(self, request: web.Request,
                                  relay: Awaitable[web.StreamResponse]) -> web.StreamResponse:
        """Relay until the relay ends or the client goes away. The server does not cancel a handler whose client
        disconnected (a lifecycle call must run to its end), but a relay must not outlive its client: the
        sandbox would stream on to nobody, and a stream the SDK gave up on would end without a word. Cancelled,
        the relay closes its upstream (the sandbox sees the disconnect, as a client's own would be seen) and says
        in the log where a silent stream stalled."""
        task = asyncio.ensure_future(relay)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=CLIENT_CHECK)
                if done:
                    return task.result()
                if request.transport is None or request.transport.is_closing():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        return await task
                    return web.Response(status=499)  # nobody reads it: the client is gone
        finally:
            task.cancel()

    async def _http(self, request: web.Request, row: SandboxRow, port: int, flight: InFlight) -> web.StreamResponse:
        client = self.agents.proxy_session(row.sandbox_id)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        scheme, host = self.inbound.upstream(row, port)
        if host is not None:
            headers["Host"] = host
        data: Any = None
        if request.body_exists:
            if request.content_length is not None:
                headers["Content-Length"] = str(request.content_length)
            data = request.content.iter_any()
        url = f"{scheme}://{row.address}:{port}{request.rel_url}"
        asked = time.monotonic()
        try:
            upstream_cm = client.request(request.method, url, headers=headers, data=data,
                                         allow_redirects=False, compress=None, ssl=False)
            upstream = await upstream_cm.__aenter__()
        except asyncio.CancelledError:
            # The client gave up waiting (its timeout): say how long the sandbox left it without an answer, the
            # evidence for a stream that never got one.
            if time.monotonic() - asked > SLOW_ANSWER:
                log.warning("%s %s to port %d of sandbox %s: the client went away after %.1f s without the "
                            "sandbox's answer; tcp: %s", request.method, request.path, port, row.sandbox_id,
                            time.monotonic() - asked, tcp_state(row.address, port))
            raise
        except aiohttp.ClientConnectorError:
            if flight.cut or self.manager.route(row.sandbox_id) is None:
                return not_found(row.sandbox_id)
            return port_closed(row.sandbox_id, port)
        except (TimeoutError, aiohttp.ClientError, RuntimeError):
            # Cut before its response started (the sandbox was killed, paused or checkpointed): a JSON 502.
            return not_found(row.sandbox_id)
        flight.upstream.append(upstream)
        if time.monotonic() - asked > SLOW_ANSWER:
            log.warning("%s %s to port %d of sandbox %s: the sandbox answered after %.1f s", request.method,
                        request.path, port, row.sandbox_id, time.monotonic() - asked)
        try:
            if flight.cut:
                return not_found(row.sandbox_id)
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in _HOP:
                    resp.headers.add(k, v)
            if upstream.headers.get("Content-Length") is not None and "Transfer-Encoding" not in upstream.headers:
                resp.content_length = int(upstream.headers["Content-Length"])
            flight.started = True
            await resp.prepare(request)
            streamed, last = 0, time.monotonic()
            try:
                async for chunk in upstream.content.iter_any():
                    streamed, last = streamed + len(chunk), time.monotonic()
                    await resp.write(chunk)
            except (asyncio.CancelledError, ConnectionResetError) as gone:
                # The client went away mid-stream. After a long silence from the sandbox, that is the evidence
                # for a stream that stalled: say where its bytes were (the host's TCP view of the connection).
                if time.monotonic() - last > SLOW_ANSWER:
                    log.warning("%s %s to port %d of sandbox %s: the client went away %.1f s into the stream, "
                                "%.1f s after the sandbox's last bytes (%d streamed); tcp: %s", request.method,
                                request.path, port, row.sandbox_id, time.monotonic() - asked,
                                time.monotonic() - last, streamed, tcp_state(row.address, port))
                if isinstance(gone, asyncio.CancelledError):
                    raise
                return resp  # a write to a client that has gone: nobody to answer
            except (TimeoutError, aiohttp.ClientError):
                # The sandbox went away mid-stream: end the client's connection uncleanly so the
                # SDK sees an interrupted stream, not a stream that ended normally.
                if request.transport is not None:
                    request.transport.close()
                return resp
            await resp.write_eof()
            return resp
        finally:
            await upstream_cm.__aexit__(None, None, None)

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
        await ws.prepare(request)

        async def pump(src: Any, dst: Any) -> None:
            async for msg in src:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    await dst.send_str(msg.data)
                elif msg.type == aiohttp.WSMsgType.BINARY:
                    await dst.send_bytes(msg.data)
                else:
                    break
            await dst.close()

        tasks = [asyncio.ensure_future(pump(ws, upstream)), asyncio.ensure_future(pump(upstream, ws))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await upstream.close()
            await ws.close()
        return ws
