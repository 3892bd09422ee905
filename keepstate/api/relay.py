"""Any node answers: a request for a sandbox that another live node owns goes to that node in one hop
(docs/design/cluster.md, "Any node answers").

The control plane's calls on one sandbox (`/sandboxes/{id}/...`) and the data plane's requests (`E2b-Sandbox-Id`,
`<port>-<id>.<domain>`) are relayed byte for byte: the request's body streams to the owner as it arrives and the
owner's answer streams back, never buffered whole; the Host header is kept, so port URLs resolve on the owner as
they would have here. A relayed request carries `X-KeepState-Relayed` and the epoch of the sandbox's row as this
node read it (`X-KeepState-Epoch`), and is never relayed again: an owner that does not hold the sandbox, or holds it
at another epoch (it moved, or this node's look is stale), answers **421** before reading a body (`refusal`), and
the relaying node forgets what it knew, looks again and, for a request without a body, retries once (one with a body
gets the 421); an owner that cannot be connected to is looked up again the same way (its lease may have ended).
Owners are remembered for OWNER_TTL_S: a hop costs no database read while they hold. A sandbox of a node that is
gone is not relayed (a connect here takes it over; anything else is this node's 404).

WebSockets go over the hop message by message: the owner's WebSocket is opened (aiohttp's `ws_connect`, the
client's path, query and headers, Host kept, its subprotocols offered) before the client's is accepted, with the
subprotocol the owner chose; an owner that refuses the upgrade gives the client its status (a 421 looks again, as
above). Then `pipe` carries text and binary messages both ways, one message at a time, and a close with its code
and reason from either end to the other (the answer to it back). Not a byte tunnel of the upgraded connection:
aiohttp's server has no public way to hand one over, and the owner's router goes into the sandbox message by message
already (router.py, which `pipe` serves too), so the path is not byte-exact end to end either way; what differs is
per hop: each hop answers pings and negotiates compression itself, and a message is read whole before it goes on
(up to aiohttp's 4 MiB, the router's limit too; one message is all that is ever held).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, NamedTuple

import aiohttp
from aiohttp import web

from keepstate.db.engine import Database
from keepstate.db.repos import Sandboxes
from keepstate.db.repos.nodes import LIVE
from keepstate.errors import Busy

log = logging.getLogger("keepstate.api.relay")

UNREACHABLE_RETRY_S = 2  # a node that cannot be connected to: about one lease renewal
RELAYED = "X-KeepState-Relayed"
EPOCH = "X-KeepState-Epoch"  # the epoch of the sandbox's row as the relaying node read it
OWNER_TTL_S = 2.0  # how long a sandbox's owner is remembered (a move meanwhile costs a 421 and one look again)
# Hop-by-hop headers (RFC 9110 7.6.1) are the hop's own. A request's Content-Length goes on with its body (streamed,
# not re-chunked: a sandbox's own server may not take chunked bodies); an answer's is set again below.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade"})
# Not passed on with a refused upgrade's status: its body is not (the answer is this node's JSON).
_REFUSED_OWN = frozenset({"content-length", "content-type", "content-encoding"})


class Owner(NamedTuple):
    """The live node that owns a sandbox, where it answers, and the epoch of the sandbox's row."""

    node: str
    address: str
    epoch: int


class Relay:
    def __init__(self, db: Database, node_id: str) -> None:
        self.node_id = node_id
        self.sandboxes = Sandboxes(db)
        self._http: aiohttp.ClientSession | None = None
        self._owners: dict[str, tuple[float, Owner | None]] = {}  # sandbox -> (until, its owner)

    async def owner(self, sandbox_id: str) -> Owner | None:
        """The live node that owns `sandbox_id`, if it is another one; None: this node answers.
        (A request relayed here already is never asked about: the caller answers it, api/app.py.)"""
        now = time.monotonic()
        known = self._owners.get(sandbox_id)
        if known is not None and known[0] > now:
            return known[1]
        found = await self.sandboxes.owner_node(sandbox_id)
        owner = None
        if found is not None and found[0] != self.node_id and found[2] in LIVE:
            owner = Owner(found[0], found[1], found[3])
        if len(self._owners) > 10000:
            self._owners = {k: v for k, v in self._owners.items() if v[0] > now}
        self._owners[sandbox_id] = (now + OWNER_TTL_S, owner)
        return owner

    def forget(self, sandbox_id: str) -> None:
        self._owners.pop(sandbox_id, None)

    def refusal(self, request: web.Request, sandbox_id: str, held: bool, epoch: int | None) -> web.Response | None:
        """For a request relayed here: a 421 if this node does not hold the sandbox, or holds it at an epoch other
        than the one the relaying node read (`epoch`: this node's, None if it has not read the row); None: it is
        this node's to answer. Nothing of the request's body has been read."""
        sent = request.headers.get(EPOCH)
        if not held:
            why = "does not hold it"
        elif sent is not None and epoch is not None and sent != str(epoch):
            why = f"holds it at epoch {epoch}, not {sent[:20]}"
        else:
            return None
        log.info("a hop from %s for sandbox %s: node %s %s", request.headers.get(RELAYED, "?")[:100], sandbox_id,
                 self.node_id, why)
        return web.json_response({"code": 421, "message": f"node {self.node_id} {why} (sandbox {sandbox_id})"},
                                 status=421)

    def client(self) -> aiohttp.ClientSession:
        """The one client session this node's hops to other nodes go through (its relays, its placed creates):
        bodies as they came, never decompressed."""
        if self._http is None:
            self._http = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=5), connector=aiohttp.TCPConnector(limit=0))
        return self._http

    async def forward(self, request: web.Request, owner: Owner, last: bool = False) -> web.StreamResponse | None:
        """The owner's answer, streamed; None if the request may go elsewhere (unless `last`): the owner answered
        421 to a request without a body, or could not be connected to (nothing of the request was read). The caller
        then forgets the owner and looks again."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        headers[RELAYED] = self.node_id
        headers[EPOCH] = str(owner.epoch)
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self._websocket(request, owner, headers, last)
        body = request.content.iter_any() if request.body_exists else None
        try:
            async with self.client().request(request.method, owner.address + str(request.rel_url),
                                              headers=headers, data=body, allow_redirects=False) as upstream:
                if upstream.status == 421 and body is None and not last:
                    return None
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for k, v in upstream.headers.items():
                    if k.lower() not in HOP_BY_HOP and k.lower() != "content-length":
                        response.headers.add(k, v)
                if upstream.headers.get("Content-Length") is not None:
                    response.content_length = int(upstream.headers["Content-Length"])
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except aiohttp.ClientConnectorError as exc:
            return self._unreachable(owner, exc, last)
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            log.warning("relaying %s %s to node %s (%s) failed: %r", request.method, request.path, owner.node,
                        owner.address, exc)
            return _bad_gateway(owner, exc)

    async def _websocket(self, request: web.Request, owner: Owner, headers: dict[str, str],
                         last: bool) -> web.StreamResponse | None:
        """The client's WebSocket, piped to one opened on the owner; None as for `forward`."""
        protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        if not web.WebSocketResponse(protocols=protocols).can_prepare(request).ok:
            return web.json_response({"code": 400, "message": "not a valid WebSocket handshake"}, status=400)
        # aiohttp makes the handshake's own (key, version, subprotocols offered, extensions) for the hop
        headers = {k: v for k, v in headers.items() if not k.lower().startswith("sec-websocket")}
        try:
            upstream = await self.client().ws_connect(owner.address + str(request.rel_url), headers=headers,
                                                       protocols=protocols, autoclose=False)
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status == 421 and not last:
                return None
            status = exc.status if 400 <= exc.status < 600 else 502
            answer = web.json_response({"code": status, "message": f"node {owner.node}, which holds the sandbox, "
                                        f"refused the WebSocket ({exc.status}: {exc.message})"}, status=status)
            for k, v in (exc.headers or {}).items():
                if k.lower() not in HOP_BY_HOP and k.lower() not in _REFUSED_OWN:
                    answer.headers.add(k, v)
            return answer
        except aiohttp.ClientConnectorError as exc:
            return self._unreachable(owner, exc, last)
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            log.warning("relaying a WebSocket %s to node %s (%s) failed: %r", request.path, owner.node,
                        owner.address, exc)
            return _bad_gateway(owner, exc)
        ws = web.WebSocketResponse(protocols=(upstream.protocol,) if upstream.protocol else (), autoclose=False)
        try:
            await ws.prepare(request)
        except BaseException:
            await upstream.close(code=aiohttp.WSCloseCode.GOING_AWAY)
            raise
        await pipe(ws, upstream)
        return ws

    def _unreachable(self, owner: Owner, exc: Exception, last: bool) -> web.Response | None:
        if not last:  # it was not reached: nothing of the request was read; the caller looks again
            log.info("node %s (%s) does not answer (%r): looking again", owner.node, owner.address, exc)
            return None
        # Nothing of the request reached it, so a retry is safe: once the node's lease has run out, another node
        # takes the sandbox over (docs/design/cluster.md, "Loss of a node"). Until then: 503, retry, not a 502.
        busy = Busy(f"the sandbox is on node {owner.node}, which does not answer at {owner.address} ({exc}); if "
                    "that node is gone, another takes the sandbox over once its lease runs out: retry",
                    retry_after=UNREACHABLE_RETRY_S)
        return web.json_response(busy.body(), status=busy.status, headers=busy.headers())

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None


RELAY = web.AppKey("relay", Relay)


def _bad_gateway(owner: Owner, exc: Exception) -> web.Response:
    return web.json_response({"code": 502, "message": f"the sandbox is on node {owner.node}, which does not "
                              f"answer at {owner.address}: {exc}"}, status=502)


# -- WebSockets ------------------------------------------------------------------------------------------------------
async def pipe(a: Any, b: Any) -> None:
    """Messages both ways between two open WebSockets (aiohttp's server or client ones) until both are closed: a
    close either end begins goes to the other end with its code and reason, and that end's answer comes back; an end
    that goes away or breaks the protocol closes the other. Cancelled, it closes both. No task outlives it."""
    tasks = [asyncio.ensure_future(_pump(a, b)), asyncio.ensure_future(_pump(b, a))]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await a.close(code=aiohttp.WSCloseCode.GOING_AWAY)  # no-ops once closed
        await b.close(code=aiohttp.WSCloseCode.GOING_AWAY)


async def _pump(src: Any, dst: Any) -> None:
    """One way of `pipe`: src's messages into dst, one at a time (src and dst are aiohttp WebSockets: typed Any, as
    the server's and the client's have no common base)."""
    try:
        while True:
            msg = await src.receive()
            if msg.type is aiohttp.WSMsgType.TEXT:
                await dst.send_str(msg.data)
            elif msg.type is aiohttp.WSMsgType.BINARY:
                await dst.send_bytes(msg.data)
            elif msg.type is aiohttp.WSMsgType.CLOSE:  # src's end closes: so does dst's, and its answer goes back
                await dst.close(code=_sendable(msg.data), message=(msg.extra or "").encode())
                await src.close(code=_sendable(dst.close_code))
                return
            elif msg.type is aiohttp.WSMsgType.CLOSING:  # the other way is closing src (the branch above)
                return
            else:  # CLOSED, ERROR: src's end went away or broke the protocol (aiohttp closed src)
                await dst.close(code=_sendable(src.close_code))
                return
    except (ConnectionError, aiohttp.ClientError) as exc:  # an end went away while a message was on its way
        log.debug("a WebSocket ends: %r", exc)
        await dst.close(code=aiohttp.WSCloseCode.GOING_AWAY)
        await src.close(code=aiohttp.WSCloseCode.GOING_AWAY)


def _sendable(code: int | None) -> int:
    """A close code that may be sent: none (0, 1005 "no status") is a normal closure, one never sent on the wire
    (1006 abnormal closure, 1015 TLS failure) an internal error."""
    if not code or code == 1005:
        return int(aiohttp.WSCloseCode.OK)
    if code in (1006, 1015):
        return int(aiohttp.WSCloseCode.INTERNAL_ERROR)
    return code
