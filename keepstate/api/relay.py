"""Any node answers: a request for a sandbox that another live node owns goes to that node in one hop
(docs/design/cluster.md, "Any node answers").

The control plane's calls on one sandbox (`/sandboxes/{id}/...`) and the data plane's requests (`E2b-Sandbox-Id`,
`<port>-<id>.<domain>`) are relayed byte for byte: the request's body streams to the owner as it arrives and the
owner's answer streams back, never buffered whole; the Host header is kept, so port URLs resolve on the owner as
they would have here. A relayed request carries `X-KeepState-Relayed` and is never relayed again: the owner answers
it from what it holds. A sandbox of a node that is gone is not relayed (a connect here takes it over; anything else
is this node's 404). Not relayed yet: WebSocket upgrades (a 502 names the owner).
"""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web

from keepstate.db.engine import Database
from keepstate.db.repos import Nodes, Sandboxes
from keepstate.db.repos.nodes import LIVE

log = logging.getLogger("keepstate.api.relay")

RELAYED = "X-KeepState-Relayed"
# Hop-by-hop headers (RFC 9110 7.6.1) are the hop's own. A request's Content-Length goes on with its body (streamed,
# not re-chunked: a sandbox's own server may not take chunked bodies); an answer's is set again below.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade"})


class Relay:
    def __init__(self, db: Database, node_id: str) -> None:
        self.node_id = node_id
        self.sandboxes = Sandboxes(db)
        self.nodes = Nodes(db)
        self._http: aiohttp.ClientSession | None = None

    async def owner(self, request: web.Request, sandbox_id: str) -> tuple[str, str] | None:
        """(node, address) of the live node that owns `sandbox_id`, if it is another one and this request may be
        relayed; None: this node answers it."""
        if RELAYED in request.headers:
            return None
        found = await self.sandboxes.get(sandbox_id)
        if found is None or found.node_id == self.node_id:
            return None
        node = await self.nodes.get(found.node_id)
        if node is None or node.state not in LIVE:
            return None
        return node.node_id, node.address

    async def forward(self, request: web.Request, node: str, address: str) -> web.StreamResponse:
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
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            log.warning("relaying %s %s to node %s (%s) failed: %r", request.method, request.path, node, address,
                        exc)
            return web.json_response({"code": 502, "message": f"the sandbox is on node {node}, which does not "
                                      f"answer at {address}: {exc}"}, status=502)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
