"""REST handlers for the templates this server offers: E2B's `GET /templates` and `GET /templates/aliases/{alias}`
(what `Template.exists(name)` asks)."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from typing import Any

from aiohttp import web

from keepstate.clock import rfc3339
from keepstate.errors import KeepStateError, NotFound
from keepstate.template.builder import Built

from .control import envd_version, manager
from .events import LINEAGE

routes = web.RouteTableDef()


def build_id(built: Built) -> str:
    """A build's ID in E2B's shape (a UUID), derived from its content digest: the same build, the same ID."""
    return str(uuid.UUID(hashlib.sha256(built.digest.encode()).hexdigest()[:32]))


def describe(built: Built, spawns: int, last_spawn: float | None, envd: str, disk_mb: int) -> dict[str, Any]:
    return {
        "templateID": built.name, "buildID": build_id(built), "cpuCount": max(1, int(built.defaults.cpu)),
        "memoryMB": built.defaults.memory_mb, "diskSizeMB": built.defaults.disk_mb or disk_mb, "public": True,
        "aliases": [built.name],
        "names": [built.name], "createdAt": rfc3339(built.built_at), "updatedAt": rfc3339(built.built_at),
        "createdBy": None, "lastSpawnedAt": rfc3339(last_spawn) if last_spawn is not None else None,
        "spawnCount": spawns, "buildCount": 1, "envdVersion": envd, "buildStatus": "ready",
    }


def _built(request: web.Request) -> list[tuple[str, Built]]:
    """Built templates; one not built yet is built on first use (and `Template.exists` already finds it)."""
    templates = manager(request).templates
    out = []
    for name in templates.names():
        try:
            built = templates.latest(name)
        except KeepStateError:
            continue  # its definition does not load: not on offer
        if built is not None:
            out.append((name, built))
    return out


async def _described(request: web.Request) -> list[dict[str, Any]]:
    lineage = request.app[LINEAGE]
    return [describe(built, *await lineage.spawns(name), envd_version(request), manager(request).disk_mb)
            for name, built in await asyncio.to_thread(_built, request)]


@routes.get("/v2/templates")
@routes.get("/templates")
async def list_templates(request: web.Request) -> web.Response:
    from .template_builds import BUILDS, described

    built = await described(request.app[BUILDS])
    return web.json_response(await _described(request) + built)


@routes.get("/default-templates")
async def default_templates(request: web.Request) -> web.Response:
    """E2B's platform templates: here, the server's own (`base`, `code-interpreter-v1` and any other TOML
    definition), in `GET /templates`' shape; templates built through the API are the caller's, not defaults."""
    return web.json_response(await _described(request))


@routes.get("/templates/aliases/{alias}")
async def alias(request: web.Request) -> web.Response:
    name = request.match_info["alias"]
    m = manager(request)
    if name in await asyncio.to_thread(m.templates.names):
        return web.json_response({"templateID": name, "public": True})
    from .template_builds import BUILDS
    from .template_builds import alias as built_alias

    found = await built_alias(request.app[BUILDS], name)
    if found is not None:
        return web.json_response(found)
    snap = await m.find_snapshot(name)
    if snap is not None:
        return web.json_response({"templateID": snap.snapshot_id, "public": False})
    raise NotFound(f"template '{name}' not found")


@routes.get("/templates/{template_id:(?!tags$)[^/]+}")  # not `/templates/tags` (POST, DELETE: tags)
async def get_template(request: web.Request) -> web.Response:
    """E2B's template detail (`TemplateWithBuilds`): the template as `GET /templates` lists it, and its builds, the
    newest first (a TOML template has one: its current build). `limit`/`nextToken` are accepted; one page holds
    every build."""
    from .template_builds import BUILDS, described

    ref = request.match_info["template_id"]
    for t in await _described(request):
        if ref in (t["templateID"], *t["aliases"]):
            return web.json_response({**t, "builds": [{
                "buildID": t["buildID"], "status": "ready", "createdAt": t["createdAt"], "updatedAt": t["updatedAt"],
                "finishedAt": t["updatedAt"], "cpuCount": t["cpuCount"], "memoryMB": t["memoryMB"],
                "diskSizeMB": t["diskSizeMB"], "envdVersion": t["envdVersion"]}]})
    builds = request.app[BUILDS]
    for t in await described(builds):
        if ref in (t["templateID"], *t["aliases"]):
            records = sorted(await builds.templates.builds(t["templateID"]), key=lambda b: b.created_at,
                             reverse=True)
            return web.json_response({**t, "builds": [{
                "buildID": b.build_id, "status": b.status, "createdAt": rfc3339(b.created_at),
                "updatedAt": rfc3339(b.finished_at or b.created_at),
                **({"finishedAt": rfc3339(b.finished_at)} if b.finished_at else {}),
                "cpuCount": t["cpuCount"], "memoryMB": t["memoryMB"]} for b in records]})
    raise NotFound(f"template '{ref}' not found")
