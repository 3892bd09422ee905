"""A create through any node of a cluster lands on the node placement chooses (docs/design/cluster.md,
"Placement").

The node that receives `POST /sandboxes` (or `/v2/sandboxes`) reads the live nodes' figures from the database
(keepstate.db.repos.placement), ranks them (keepstate.cluster.placement: best of K) and either answers the create
itself, if it comes first, or sends it to the chosen node in one hop, marked relayed so that it is not placed
again. The body is a small JSON object, read whole (the API's limit), so a node that refuses (503: it filled up
meanwhile, is draining or stopping) or cannot be reached costs a try of the next node, not the create. When no node
takes it the answer is 503 with `Retry-After`, never a 500 (with no other node to try, this node answers: its own
503 says why, such as a drain).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from keepstate.cluster.placement import ranked
from keepstate.db.engine import Database
from keepstate.db.records import NodeRecord
from keepstate.db.repos.placement import Placement
from keepstate.errors import Busy, KeepStateError

from .relay import HOP_BY_HOP, RELAYED

log = logging.getLogger("keepstate.api.placement")

CREATE_PATHS = ("/sandboxes", "/v2/sandboxes")
DEFAULT_CPU, DEFAULT_MEMORY_MB = 2.0, 512  # what a create that names neither is counted as
RETRY_AFTER_S = 5  # when every node is full: about one sandbox's life in a busy cluster, not a measured figure


def is_create(request: web.Request) -> bool:
    return request.method == "POST" and request.path in CREATE_PATHS and RELAYED not in request.headers


class Placer:
    def __init__(self, db: Database, node_id: str, client: Callable[[], aiohttp.ClientSession],
                 room: Callable[[], bool] = lambda: True) -> None:
        self.node_id = node_id
        self.client = client  # the relay's session (api/relay.py): one pool of connections to the other nodes
        self.room = room  # whether this node's own admission has a place now (its figures are ahead of the rows')
        self.rng = random.Random()  # draws the K candidates (a test seeds it)
        self.placement = Placement(db)

    async def place(self, request: web.Request) -> web.StreamResponse | None:
        """The chosen node's answer to this create; None: this node answers it (it came first, or the database
        could not be read, or the body is not one to place: the handler gives its 400)."""
        body = await request.read()
        ask = _ask(body)
        if ask is None:
            return None
        try:
            loads = await self.placement.loads()
        except KeepStateError as exc:  # the database is away: this node answers what it can
            log.warning("placement could not read the nodes (%s): creating here", exc)
            return None
        refused: list[str] = []
        for node in ranked(loads, *ask, rng=self.rng):
            if node.node_id == self.node_id:
                if self.room():
                    return None
                refused.append(f"node {node.node_id} holds its limit of sandboxes")
                continue
            answer = await self._forward(request, node, body, refused)
            if answer is not None:
                return answer
        if not any(not r.startswith(f"node {self.node_id} ") for r in refused):
            return None  # no other node to try: this one says why it cannot (draining, full)
        why = "; ".join(refused)
        busy = Busy(f"no node of the cluster can take a sandbox now ({why}); retry in {RETRY_AFTER_S} s",
                    retry_after=RETRY_AFTER_S, error_code="sandbox_capacity_unavailable")
        return web.json_response(busy.body(), status=busy.status, headers=busy.headers())

    async def _forward(self, request: web.Request, node: NodeRecord, body: bytes,
                       refused: list[str]) -> web.Response | None:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP | {"content-length"}}
        headers[RELAYED] = self.node_id
        try:
            async with self.client().post(node.address + str(request.rel_url), data=body, headers=headers) as answer:
                data = await answer.read()
                if answer.status == 503:
                    refused.append(f"node {node.node_id}: {_message(data)}")
                    return None
                kept = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP | {"content-length"}}
                return web.Response(body=data, status=answer.status, headers=kept)
        except (aiohttp.ClientError, TimeoutError) as exc:
            refused.append(f"node {node.node_id} does not answer at {node.address}")
            log.info("placing a create on node %s (%s) failed: %r; trying the next", node.node_id, node.address,
                     exc)
            return None


def _ask(body: bytes) -> tuple[float, int, str | None] | None:
    """(CPUs, memory, template) the create asks for, as far as placement needs them; None: not a JSON object."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    template = value.get("templateID")
    return (_number(value.get("cpuCount"), DEFAULT_CPU), int(_number(value.get("memoryMB"), DEFAULT_MEMORY_MB)),
            template if isinstance(template, str) else None)


def _number(value: Any, default: float) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value == value and value > 0
    return float(value) if ok else default


def _message(data: bytes) -> str:
    try:
        found = json.loads(data).get("message")
    except (ValueError, AttributeError):
        found = None
    return str(found) if found else data[:200].decode(errors="replace")


PLACER = web.AppKey("placer", Placer)  # a node's placement (tests seed its draws)
