"""REST handlers for sessions' causal history and lineage (docs/design/causal-history.md).

The server sets the EventLog and the Lineage on the app as `app[EVENTS]` and `app[LINEAGE]`.
"""

from __future__ import annotations

from aiohttp import web

from keepstate.errors import NotFound
from keepstate.session import EventLog, Lineage

from .control import sid
from .schemas import query_bool, query_int

routes = web.RouteTableDef()
MAX_LIMIT = 10_000
MAX_SEQ = 2**63 - 1  # SQLite's INTEGER and PostgreSQL's BIGINT: a larger `after` would overflow its binding
EVENTS: web.AppKey[EventLog] = web.AppKey("events", EventLog)
LINEAGE: web.AppKey[Lineage] = web.AppKey("lineage", Lineage)


def _event_log(request: web.Request) -> EventLog:
    return request.app[EVENTS]


def _lineage(request: web.Request) -> Lineage:
    return request.app[LINEAGE]


@routes.get("/sandboxes/{sandbox_id}/events")
async def list_events(request: web.Request) -> web.Response:
    log = _event_log(request)
    session_id = sid(request)
    after = query_int(request.query, "after", 0, 0, MAX_SEQ)
    limit = min(query_int(request.query, "limit", MAX_LIMIT, 1, MAX_SEQ), MAX_LIMIT)
    verify = query_bool(request.query, "verify")
    events = await log.read(session_id, after, limit)
    if not events and not await log.exists(session_id):
        raise NotFound(f"no events for sandbox {session_id}")
    body: dict[str, object] = {"sessionId": session_id, "events": [e.to_dict() for e in events]}
    if verify:
        body["verified"] = (await log.verify(session_id)).to_dict()
    return web.json_response(body)


@routes.get("/sandboxes/{sandbox_id}/lineage")
async def lineage(request: web.Request) -> web.Response:
    tree = await _lineage(request).tree(sid(request))
    return web.json_response(tree)
