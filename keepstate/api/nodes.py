"""`GET /nodes`: the cluster's nodes, as every node of it sees them in the shared database (docs/design/cluster.md)."""

from __future__ import annotations

from aiohttp import web

from keepstate.cluster.membership import Membership
from keepstate.cluster.view import node_json
from keepstate.db.repos import Nodes

from .keys import DATABASE

routes = web.RouteTableDef()
MEMBERSHIP = web.AppKey("membership", Membership)


@routes.get("/nodes")
async def list_nodes(request: web.Request) -> web.Response:
    found, now = await Nodes(request.app[DATABASE]).shown()
    me = request.app[MEMBERSHIP].me.node_id
    return web.json_response([node_json(n, now, me) for n in found])
