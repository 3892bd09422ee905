"""Any node answers: a request for a sandbox that another live node owns goes to that node in one hop
(docs/design/cluster.md, "Any node answers").

The control plane's calls on one sandbox (`/sandboxes/{id}/...`) and the data plane's requests (`E2b-Sandbox-Id`,
`<port>-<id>.<domain>`) are relayed byte for byte: the request's body streams to the owner as it arrives and the
owner's answer streams back, never buffered whole; the Host header is kept, so port URLs resolve on the owner as
they would have here. A relayed request carries `X-KeepState-Relayed` and is never relayed again: an owner that no
longer holds the sandbox answers **421** before reading a body, and the relaying node forgets what it knew, looks
again and, for a request without a body, retries once (one with a body gets the 421); an owner that cannot be
connected to is looked up again the same way (its lease may have ended). Owners are remembered for
OWNER_TTL_S: a hop costs no database read while they hold. A sandbox of a node that is gone is not relayed (a connect
here takes it over; anything else is this node's 404). Not relayed yet: WebSocket upgrades (a 502 names the owner).
"""

from __future__ import annotations

import logging
import time

import aiohttp
from aiohttp import web

from keepstate.db.engine import Database
from keepstate.db.repos import Sandboxes
from keepstate.db.repos.nodes import LIVE

log = logging.getLogger("keepstate.api.relay")

RELAYED = "X-KeepState-Relayed"
OWNER_TTL_S = 2.0  # how long a sandbox's owner is remembered (a move meanwhile costs a 421 and one look again)
# Hop-by-hop headers (RFC 9110 7.6.1) are the hop's own. A request's Content-Length goes on with its body (streamed,
# not re-chunked: a sandbox's own server may not take chunked bodies); an answer's is set again below.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade"})


class Relay:
    def __init__(self, db: Database, node_id: str) -> None:
        self.node_id = node_id
        self.sandboxes = Sandboxes(db)
        self._http: aiohttp.ClientSession | None = None
        self._owners: dict[str, tuple[float, tuple[str, str] | None]] = {}  # sandbox -> (until, (node, address))

    async def owner(self, sandbox_id: str) -> tuple[str, str] | None:
        """(node, address) of the live node that owns `sandbox_id`, if it is another one; None: this node answers.
        (A request relayed here already is never asked about: the caller answers it, api/app.py.)"""
        now = time.monotonic()
        known = self._owners.get(sandbox_id)
        if known is not None and known[0] > now:
            return known[1]
        found = await self.sandboxes.owner_node(sandbox_id)
        owner = None
        if found is not None and found[0] != self.node_id and found[2] in LIVE:
            owner = (found[0], found[1])
        if len(self._owners) > 10000:
            self._owners = {k: v for k, v in self._owners.items() if v[0] > now}
        self._owners[sandbox_id] = (now + OWNER_TTL_S, owner)
        return owner

    def forget(self, sandbox_id: str) -> None:
        self._owners.pop(sandbox_id, None)

    async def forward(self, request: web.Request, node: str, address: str,
                      last: bool = False) -> web.StreamResponse | None:
        """The owner's answer, streamed; None if the request may go elsewhere (unless `last`): the owner answered
        421 to a request without a body, or could not be connected to (nothing of the request was read). The caller
        then forgets the owner and looks again."""
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return web.json_response({"code": 502, "message": f"the sandbox is on node {node} ({address}): "
                                      "WebSockets are not relayed between nodes yet; connect to that node"},
                                     status=502)
        if self._http is None:
            self._http = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=5), connector=aiohttp.TCPConnector(limit=0))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        headers[RELAYED] = self.node_id
        body = request.content.iter_any() if request.body_exists else None
        try:
            async with self._http.request(request.method, address + str(request.rel_url), headers=headers,
                                          data=body, allow_redirects=False) as upstream:
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
            if not last:  # it was not reached: nothing of the request was read; the caller looks again
                log.info("node %s (%s) does not answer (%r): looking again", node, address, exc)
                return None
            return web.json_response({"code": 502, "message": f"the sandbox is on node {node}, which does not "
                                      f"answer at {address}: {exc}"}, status=502)
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            log.warning("relaying %s %s to node %s (%s) failed: %r", request.method, request.path, node, address,
                        exc)
            return web.json_response({"code": 502, "message": f"the sandbox is on node {node}, which does not "
                                      f"answer at {address}: {exc}"}, status=502)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
