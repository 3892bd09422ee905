"""REST handlers for a sandbox's logs, E2B's v1 and v2 (docs/design/sandbox-logs.md): a view of its history."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from keepstate.errors import BadRequest, NotFound
from keepstate.session import EventLog
from keepstate.session.event import Event
from keepstate.session.sandbox_log import LEVELS, select

from .events import EVENTS

routes = web.RouteTableDef()
V1_MAX = 10_000
V2_MAX = 1000
SEARCH_MAX = 256
PAGE = 10_000


def _int(request: web.Request, name: str, default: int, high: int) -> int:
    raw = request.query.get(name, "")
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"query parameter `{name}` must be a whole number, got {raw!r}") from None
    if not 0 <= value <= high:
        raise BadRequest(f"query parameter `{name}` must be from 0 to {high}")
    return value


def _choice(request: web.Request, name: str, allowed: tuple[str, ...]) -> str | None:
    raw = request.query.get(name, "")
    if raw == "":
        return None
    if raw not in allowed:
        raise BadRequest(f"query parameter `{name}` must be one of {', '.join(allowed)}, got {raw!r}")
    return raw


def _history(log: EventLog, session_id: str) -> list[Event]:
    events: list[Event] = []
    while page := log.read(session_id, events[-1].seq if events else 0, PAGE):
        events.extend(page)
    if not events:
        raise NotFound(f"sandbox \"{session_id}\" not found (it has no history here)")
    return events


def _session_id(request: web.Request) -> str:
    return request.match_info["sandbox_id"].split("-")[0]  # old SDKs send "<id>-<clientID>"


@routes.get("/sandboxes/{sandbox_id}/logs")
async def logs_v1(request: web.Request) -> web.Response:
    start = _int(request, "start", 0, 2**53)
    limit = _int(request, "limit", 1000, V1_MAX)
    events = await asyncio.to_thread(_history, request.app[EVENTS], _session_id(request))
    entries = select(events, cursor_ms=start, limit=limit)
    return web.json_response({"logs": [{"timestamp": e.to_json()["timestamp"], "line": e.message} for e in entries],
                              "logEntries": [e.to_json() for e in entries]})


@routes.get("/v2/sandboxes/{sandbox_id}/logs")
async def logs_v2(request: web.Request) -> web.Response:
    backward = _choice(request, "direction", ("forward", "backward")) == "backward"
    cursor = _int(request, "cursor", int(time.time() * 1000) if backward else 0, 2**53)
    limit = _int(request, "limit", V2_MAX, V2_MAX)
    level = _choice(request, "level", LEVELS)
    search = request.query.get("search") or None
    if search is not None and len(search) > SEARCH_MAX:
        raise BadRequest(f"query parameter `search` must be at most {SEARCH_MAX} characters")
    events = await asyncio.to_thread(_history, request.app[EVENTS], _session_id(request))
    entries = select(events, cursor_ms=cursor, backward=backward, level=level, search=search, limit=limit)
    return web.json_response({"logs": [e.to_json() for e in entries]})
