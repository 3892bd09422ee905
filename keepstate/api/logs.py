"""REST handlers for a sandbox's logs, E2B's v1 and v2 (docs/design/sandbox-logs.md): a view of its history."""

from __future__ import annotations

import time

from aiohttp import web

from keepstate.errors import BadRequest, NotFound
from keepstate.session import EventLog
from keepstate.session.event import Event
from keepstate.session.sandbox_log import LEVELS, select

from .control import sid
from .events import EVENTS
from .schemas import query_choice, query_int

routes = web.RouteTableDef()
V1_MAX = 10_000
V2_MAX = 1000
SEARCH_MAX = 256
PAGE = 10_000
MAX_MS = 2**53  # cursors: milliseconds since the epoch, as docs/openapi.yaml bounds them


async def _history(log: EventLog, session_id: str) -> list[Event]:
    events: list[Event] = []
    while page := await log.read(session_id, events[-1].seq if events else 0, PAGE):
        events.extend(page)
    if not events:
        raise NotFound(f"sandbox \"{session_id}\" not found (it has no history here)")
    return events


@routes.get("/sandboxes/{sandbox_id}/logs")
async def logs_v1(request: web.Request) -> web.Response:
    start = query_int(request.query, "start", 0, 0, MAX_MS)
    limit = query_int(request.query, "limit", 1000, 0, V1_MAX)
    events = await _history(request.app[EVENTS], sid(request))
    entries = [e.to_json() for e in select(events, cursor_ms=start, limit=limit)]
    return web.json_response({"logs": [{"timestamp": e["timestamp"], "line": e["message"]} for e in entries],
                              "logEntries": entries})


@routes.get("/v2/sandboxes/{sandbox_id}/logs")
async def logs_v2(request: web.Request) -> web.Response:
    query = request.query
    backward = query_choice(query, "direction", ("forward", "backward")) == "backward"
    cursor = query_int(query, "cursor", int(time.time() * 1000) if backward else 0, 0, MAX_MS)
    limit = query_int(query, "limit", V2_MAX, 0, V2_MAX)
    level = query_choice(query, "level", LEVELS)
    search = request.query.get("search") or None
    if search is not None and len(search) > SEARCH_MAX:
        raise BadRequest(f"query parameter `search` must be at most {SEARCH_MAX} characters")
    events = await _history(request.app[EVENTS], sid(request))
    entries = select(events, cursor_ms=cursor, backward=backward, level=level, search=search, limit=limit)
    return web.json_response({"logs": [e.to_json() for e in entries]})
