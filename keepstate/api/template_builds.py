"""REST handlers of E2B's template build protocol (docs/design/template-builds.md); the work is in
keepstate/builds/service.py. Parse and render only."""

from __future__ import annotations

import asyncio
import os
from datetime import datetime
from typing import Any

from aiohttp import web

from keepstate.builds.service import DEFAULT_TAG, TAG_RE, TemplateBuilds, split_ref
from keepstate.builds.steps import is_gzip, parse_spec
from keepstate.builds.uploads import PREFIX
from keepstate.clock import rfc3339
from keepstate.errors import BadRequest, NotFound

from .keys import API_KEY_ID

routes = web.RouteTableDef()
BUILDS: web.AppKey[TemplateBuilds] = web.AppKey("template_builds", TemplateBuilds)

MAX_UPLOAD = 8 << 30


def builds(request: web.Request) -> TemplateBuilds:
    return request.app[BUILDS]


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise BadRequest("the body must be JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _int(body: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = body.get(key)
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadRequest(f"`{key}` must be a whole number from {lo} to {hi}")
    return v


def _tags(body: dict[str, Any], key: str = "tags") -> list[str]:
    tags = body.get(key) or []
    if not isinstance(tags, list) or not all(isinstance(t, str) and TAG_RE.match(t) for t in tags):
        raise BadRequest(f"`{key}` must be a list of tags (letters, digits and . _ -)")
    return list(tags)


@routes.post("/v3/templates")
async def request_build(request: web.Request) -> web.Response:
    body = await _json(request)
    name = body.get("name")
    if not isinstance(name, str) or not name.strip():
        raise BadRequest("`name` must be a non-empty string (name or name:tag)")
    t, b, tags = await builds(request).request(name.strip(), _tags(body), _int(body, "cpuCount", 1, 8),
                                               _int(body, "memoryMB", 128, 65536))
    return web.json_response({"templateID": t.template_id, "buildID": b.build_id, "public": False,
                              "names": [t.name], "tags": tags, "aliases": [t.name]}, status=202)


@routes.get("/templates/{template_id}/files/{files_hash}")
async def files_link(request: web.Request) -> web.Response:
    s = builds(request)
    await s.template(request.match_info["template_id"])
    files_hash = request.match_info["files_hash"]
    present = s.uploads.present(files_hash)
    base = f"{request.scheme}://{request.host}"
    return web.json_response({"present": present, "url": s.uploads.url(base, files_hash)}, status=201)


@routes.put(PREFIX + "{files_hash}")
async def upload(request: web.Request) -> web.Response:
    """No API key (the SDK sends none): the URL's signature authorises it (uploads.py)."""
    s = builds(request)
    files_hash = request.match_info["files_hash"]
    s.uploads.check(files_hash, request.query.get("expires", ""), request.query.get("signature", ""))
    fd, tmp = s.uploads.receive(files_hash)
    size = 0
    try:
        with os.fdopen(fd, "wb") as out:
            async for chunk in request.content.iter_chunked(1 << 20):
                size += len(chunk)
                if size > MAX_UPLOAD:
                    raise BadRequest(f"an upload may be at most {MAX_UPLOAD >> 30} GiB")
                await asyncio.to_thread(out.write, chunk)
        with open(tmp, "rb") as f:
            head = f.read(512)
        if not head:
            raise BadRequest("the upload is empty: PUT the tar archive (gzip or not) of the step's files")
        if not is_gzip(head) and (len(head) < 262 or head[257:262] != b"ustar"):
            raise BadRequest("the upload is neither a tar archive nor a gzip-compressed one")
        s.uploads.commit(files_hash, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return web.json_response({"filesHash": files_hash, "size": size}, status=201)


@routes.post("/v2/templates/{template_id}/builds/{build_id}")
async def start_build(request: web.Request) -> web.Response:
    spec = parse_spec(await _json(request))
    await builds(request).start(request.match_info["template_id"], request.match_info["build_id"], spec,
                                request.get(API_KEY_ID))
    return web.Response(status=202)


@routes.get("/templates/{template_id}/builds/{build_id}/status")
async def build_status(request: web.Request) -> web.Response:
    try:
        offset = max(0, int(request.query.get("logsOffset", "0")))
        limit = min(max(1, int(request.query.get("limit", "100"))), 1000)
    except ValueError:
        raise BadRequest("`logsOffset` and `limit` must be whole numbers") from None
    return web.json_response(await builds(request).status(request.match_info["template_id"],
                                                          request.match_info["build_id"], offset, limit))


LEVELS = ("debug", "info", "warn", "error")


@routes.get("/templates/{template_id}/builds/{build_id}/logs")
async def build_logs(request: web.Request) -> web.Response:
    """E2B's logs route: the entries the status route carries, by time (`cursor`, ms) and level."""
    q = request.query
    try:
        cursor = int(q["cursor"]) if "cursor" in q else None
        limit = int(q.get("limit", "100"))
    except ValueError:
        raise BadRequest("`cursor` (milliseconds since the epoch) and `limit` must be whole numbers") from None
    direction, level = q.get("direction", "forward"), q.get("level", "debug")
    if not 1 <= limit <= 1000 or (cursor is not None and cursor < 0):
        raise BadRequest("`limit` must be 1 to 1000 and `cursor` not negative")
    if direction not in ("forward", "backward") or level not in LEVELS \
            or q.get("source", "persistent") not in ("temporary", "persistent"):
        raise BadRequest("`direction` is forward or backward, `level` one of debug, info, warn, error, `source` "
                         "temporary or persistent")
    status = await builds(request).status(request.match_info["template_id"], request.match_info["build_id"], 0,
                                          1 << 30)
    entries = [e for e in status["logEntries"] if LEVELS.index(e.get("level", "info")) >= LEVELS.index(level)]
    if direction == "backward":
        entries.reverse()
    if cursor is not None:
        def ms(entry: dict[str, Any]) -> int:
            return int(datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp() * 1000)

        entries = [e for e in entries if (ms(e) >= cursor if direction == "forward" else ms(e) <= cursor)]
    return web.json_response({"logs": entries[:limit]})


@routes.post("/templates/tags")
async def assign_tags(request: web.Request) -> web.Response:
    body = await _json(request)
    target, tags = body.get("target"), _tags(body)
    if not isinstance(target, str) or not target or not tags:
        raise BadRequest("`target` (name:tag) and a non-empty `tags` list are required")
    s = builds(request)
    b = await s.ready_build(target)
    if b is None:
        raise NotFound(f"template '{target}' has no ready build")
    for tag in tags:
        await s.templates.set_tag(b.template_id, tag, b.build_id)
    return web.json_response({"tags": tags, "buildID": b.build_id}, status=201)


@routes.delete("/templates/tags")
async def remove_tags(request: web.Request) -> web.Response:
    body = await _json(request)
    name, tags = body.get("name"), _tags(body)
    if not isinstance(name, str) or not name or not tags:
        raise BadRequest("`name` and a non-empty `tags` list are required")
    s = builds(request)
    t = await s.template(name)
    missing = [tag for tag in tags if not await s.templates.delete_tag(t.template_id, tag)]
    if missing:
        raise NotFound(f"template '{name}' has no tag(s) {', '.join(missing)}")
    return web.Response(status=204)


@routes.get("/templates/{template_id}/tags")
async def list_tags(request: web.Request) -> web.Response:
    s = builds(request)
    t = await s.template(request.match_info["template_id"])
    return web.json_response([{"tag": r.tag, "buildID": r.build_id, "createdAt": rfc3339(r.created_at)}
                              for r in await s.templates.tags(t.template_id)])


@routes.delete("/templates/{template_id}")
async def delete_template(request: web.Request) -> web.StreamResponse:
    """A built template, else a snapshot (what `Sandbox.delete_snapshot` sends here too)."""
    s, ref = builds(request), request.match_info["template_id"]
    if await s.templates.get_template(split_ref(ref)[0]) is None:
        from .control import delete_snapshot

        return await delete_snapshot(request)
    await s.delete(ref)
    return web.Response(status=204)


async def described(s: TemplateBuilds) -> list[dict[str, Any]]:
    """Built templates in `GET /templates`' shape (their default tag's ready build)."""
    out = []
    for t in await s.templates.templates():
        b = await s.ready_build(f"{t.name}:{DEFAULT_TAG}")
        builds_of = await s.templates.builds(t.template_id)
        last = builds_of[-1] if builds_of else None
        out.append({"templateID": t.template_id, "buildID": b.build_id if b else (last.build_id if last else ""),
                    "cpuCount": t.cpu or 2, "memoryMB": t.memory_mb or 1024, "diskSizeMB": 0, "public": False,
                    "aliases": [t.name], "names": [t.name], "createdAt": rfc3339(t.created_at),
                    "updatedAt": rfc3339(t.updated_at), "createdBy": None, "lastSpawnedAt": None,
                    "spawnCount": 0, "buildCount": len(builds_of), "envdVersion": "",
                    "buildStatus": b.status if b else (last.status if last else "waiting")})
    return out


async def alias(s: TemplateBuilds, ref: str) -> dict[str, Any] | None:
    t = await s.templates.get_template(split_ref(ref)[0])
    return {"templateID": t.template_id, "public": False} if t is not None else None
