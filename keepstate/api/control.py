"""Control-plane handlers: E2B's REST API (shared/docs/e2b-protocol.md section 2).

Handlers parse with schemas.py, call the SandboxManager and render; nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from keepstate.errors import BadRequest, KeepStateError, NotFound
from keepstate.sandbox.manager import MAX_TIMEOUT, SandboxManager
from keepstate.sandbox.state import PUBLIC

from . import schemas
from .keys import API_KEY_ID, DOMAIN, ENVD_VERSION, IDEMPOTENT, MANAGER, TIMEOUT_LIMIT
from .spec import Spec

routes = web.RouteTableDef()
MAX_METRICS_IDS = 100
# `/sandboxes/metrics` is a route of its own, not a sandbox's ID (or its 405s would advertise DELETE).
ONE_SANDBOX = r"/sandboxes/{sandbox_id:(?!metrics$)[^\x2f]+}"


def manager(request: web.Request) -> SandboxManager:
    return request.app[MANAGER]


def envd_version(request: web.Request) -> str:
    return request.app[ENVD_VERSION]


def domain(request: web.Request) -> str | None:
    return request.app.get(DOMAIN)


def timeout_limit(request: web.Request) -> int:
    """The longest timeout a create, connect, resume, fork or set-timeout may ask (`serve --max-timeout`; 0: none)."""
    return request.app.get(TIMEOUT_LIMIT, MAX_TIMEOUT)


async def json_body(request: web.Request, required: bool = True) -> Any:
    """The body as JSON, None when there is none; bytes that are not UTF-8 JSON with finite numbers are a 400
    (schemas.parse_json), and so is a literal `null`: every body we take is an object."""
    raw = await request.read()
    value = schemas.parse_json(raw, required)
    if value is None and raw.strip():
        raise BadRequest("request body must be a JSON object, not null")
    if value is not None:
        check_body(request, value)
    return value


async def object_body(request: web.Request) -> dict[str, Any]:
    """An optional JSON object body: absent means {}; any other JSON value is a 400."""
    value = schemas.parse_object(await request.read())
    check_body(request, value)
    return value


def check_body(request: web.Request, value: Any) -> None:
    """A 400 naming what the body gets wrong against its operation's schema in docs/openapi.yaml."""
    resource = request.match_info.route.resource
    if resource is None:
        return
    problems = Spec.default().check_request(request.method, resource.canonical, value)
    if problems:
        raise BadRequest("request body does not match the API (docs/openapi.yaml): " + "; ".join(problems[:5]))


def sid(request: web.Request) -> str:
    value = request.match_info["sandbox_id"]
    # The SDK may send "<id>-<clientID>" from very old versions; the ID is the part before '-'.
    return value.split("-")[0]


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    m = manager(request)
    pools: dict[str, int] = {}
    claims: dict[str, int] = {}
    for pool in m.pools.values():
        pools[pool.template] = pools.get(pool.template, 0) + len(pool)
        claims[pool.template] = claims.get(pool.template, 0) + pool.claims
    return web.json_response({"status": "ok", "message": "Health check successful", "pools": pools,
                              "poolClaims": claims,
                              "running": len(m.running()), "admission": m.admission(),
                              "teardowns": m.teardowns_pending()})


@routes.post("/v2/sandboxes")
@routes.post("/sandboxes")
async def create(request: web.Request) -> web.Response:
    req = schemas.parse_create(await json_body(request), timeout_limit(request))

    async def run(sandbox_id: str | None) -> web.Response:
        req.sandbox_id = sandbox_id
        row = await manager(request).create(req, request.get(API_KEY_ID))
        return web.json_response(schemas.sandbox(row, envd_version(request), domain(request)), status=201)

    return await request.app[IDEMPOTENT].run(request, request.get(API_KEY_ID), run)  # api/idempotent.py


def recorded_answer(app: web.Application) -> Callable[[str], Awaitable[str | None]]:
    """The 201 body a create of `sandbox_id` answered, built again from its row (None: no row): what an idempotent
    create's retry gets when the first attempt's server crashed before it stored the answer."""
    async def answer(sandbox_id: str) -> str | None:
        m = app[MANAGER]
        row = m.table.find(sandbox_id)
        if row is None:
            found = await m.rows.peek(sandbox_id)
            if found is None:
                return None
            row = found[1]
        return json.dumps(schemas.sandbox(row, app[ENVD_VERSION], app.get(DOMAIN)))

    return answer


@routes.post("/v2/sandboxes/{sandbox_id}/connect")
@routes.post("/sandboxes/{sandbox_id}/connect")
async def connect(request: web.Request) -> web.Response:
    body = await json_body(request, required=False)
    timeout = schemas.parse_timeout_body(body, required=False, limit=timeout_limit(request))
    if timeout <= 0:
        raise BadRequest("`timeout` must be a positive number of seconds")
    memory = body.get("memory", True) if isinstance(body, dict) else True
    if not isinstance(memory, bool):
        raise BadRequest("`memory` must be a boolean")
    try:
        row, resumed = await manager(request).connect(sid(request), timeout, memory=memory)
    except NotFound:
        raise NotFound(f"Paused sandbox {sid(request)} not found") from None
    return web.json_response(schemas.sandbox(row, envd_version(request), domain(request)),
                             status=201 if resumed else 200)


@routes.get("/sandboxes/metrics")
async def metrics_of_many(request: web.Request) -> web.Response:
    """The latest metrics sample of each named sandbox that has one: `?sandbox_ids=a,b` (at most 100)."""
    raw = request.query.get("sandbox_ids", "")
    ids = list(dict.fromkeys(i.strip() for i in raw.split(",") if i.strip()))
    if not ids:
        raise BadRequest("query parameter `sandbox_ids` (comma-separated sandbox IDs) is required")
    if len(ids) > MAX_METRICS_IDS:
        raise BadRequest(f"query parameter `sandbox_ids` names at most {MAX_METRICS_IDS} sandboxes")
    return web.json_response({"sandboxes": manager(request).latest_metrics(ids)})


@routes.post("/sandboxes/{sandbox_id}/resume")
async def resume(request: web.Request) -> web.Response:
    """E2B's older resume: a paused sandbox only (a running one is a 409, unlike connect)."""
    timeout, auto_pause, memory = schemas.parse_resume_body(await object_body(request), timeout_limit(request))
    try:
        row = await manager(request).resume(sid(request), timeout, auto_pause, memory=memory)
    except NotFound:
        raise NotFound(f"Paused sandbox {sid(request)} not found") from None
    return web.json_response(schemas.sandbox(row, envd_version(request), domain(request)), status=201)


@routes.post("/sandboxes/{sandbox_id}/refreshes")
async def refresh(request: web.Request) -> web.Response:
    await manager(request).refresh(sid(request), schemas.parse_refresh_body(await object_body(request)))
    return web.Response(status=204)


@routes.get(ONE_SANDBOX)
async def get_info(request: web.Request) -> web.Response:
    row = manager(request).get(sid(request))
    return web.json_response(schemas.detail(row, envd_version(request), domain(request)))


@routes.delete(ONE_SANDBOX)
async def kill(request: web.Request) -> web.Response:
    await manager(request).kill(sid(request))
    return web.Response(status=204)


@routes.post("/sandboxes/{sandbox_id}/timeout")
async def set_timeout(request: web.Request) -> web.Response:
    seconds = schemas.parse_timeout_body(await json_body(request), required=True, limit=timeout_limit(request))
    await manager(request).set_timeout(sid(request), seconds)
    return web.Response(status=204)


@routes.put("/sandboxes/{sandbox_id}/network")
async def update_network(request: web.Request) -> web.Response:
    """Replace a running sandbox's egress policy at once (E2B's update_network); a bad body changes nothing."""
    await manager(request).update_network(sid(request), await json_body(request))
    return web.Response(status=204)


@routes.get("/v2/sandboxes")
async def list_v2(request: web.Request) -> web.Response:
    rows = await manager(request).table.cluster_listed()
    page, token = schemas.filter_and_page(rows, dict(request.query))
    headers = {"X-Total-Running": str(sum(1 for r in rows if PUBLIC.get(r.state) == "running"))}
    if token:
        headers["X-Next-Token"] = token
    return web.json_response([schemas.listed(r, envd_version(request), domain(request)) for r in page], headers=headers)


@routes.get("/sandboxes")
async def list_v1(request: web.Request) -> web.Response:
    query = {"state": "running", "limit": "100"}
    if request.query.get("metadata"):
        query["metadata"] = request.query["metadata"]
    rows = await manager(request).table.cluster_listed()
    out = []
    while True:
        page, token = schemas.filter_and_page(rows, query)
        out.extend(page)
        if not token:
            break
        query["nextToken"] = token
    return web.json_response([schemas.listed(r, envd_version(request), domain(request)) for r in out])


@routes.get("/sandboxes/{sandbox_id}/metrics")
async def metrics(request: web.Request) -> web.Response:
    def num(name: str) -> float | None:
        v = request.query.get(name)
        if v is None:
            return None
        try:
            return float(v)
        except ValueError:
            raise BadRequest(f"`{name}` must be a unix time in seconds") from None

    samples = manager(request).metric_samples(sid(request), num("start"), num("end"))
    return web.json_response(samples)


@routes.post("/sandboxes/{sandbox_id}/pause")
async def pause(request: web.Request) -> web.Response:
    memory, require_healthy = schemas.parse_pause_body(await object_body(request))
    await manager(request).pause(sid(request), memory=memory, require_healthy=require_healthy)
    return web.Response(status=204)


@routes.post("/sandboxes/{sandbox_id}/snapshots")
async def create_snapshot(request: web.Request) -> web.Response:
    name, memory = schemas.parse_snapshot_body(await object_body(request))
    info = await manager(request).snapshot(sid(request), name, memory=memory)
    return web.json_response(info, status=201)


@routes.get("/snapshots")
async def list_snapshots(request: web.Request) -> web.Response:
    snaps = await manager(request).rows.snapshots()
    if request.query.get("sandboxID"):
        snaps = [s for s in snaps if s.sandbox_id == request.query["sandboxID"]]
    if request.query.get("name"):
        snaps = [s for s in snaps if request.query["name"] in s.names]
    try:
        limit = int(request.query.get("limit", "100"))
        start = int(request.query.get("nextToken", "0") or 0)
    except ValueError:
        raise BadRequest("`limit` and `nextToken` must be whole numbers") from None
    if start < 0:
        raise BadRequest("`nextToken` must be a token from an earlier page")
    page = snaps[start:start + max(1, min(limit, 100))]
    headers = {"X-Next-Token": str(start + len(page))} if start + len(page) < len(snaps) else {}
    return web.json_response([{"snapshotID": s.snapshot_id, "names": list(s.names)} for s in page],
                             headers=headers)


@routes.delete("/templates/{template_id}")
async def delete_snapshot(request: web.Request) -> web.Response:
    m = manager(request)
    snap = await m.find_snapshot(request.match_info["template_id"])
    if snap is None:
        raise NotFound(f"snapshot '{request.match_info['template_id']}' not found")
    await m.rows.delete_snapshot(snap.snapshot_id)
    return web.Response(status=204)


@routes.post("/v2/sandboxes/{sandbox_id}/fork")
@routes.post("/sandboxes/{sandbox_id}/fork")
async def fork(request: web.Request) -> web.Response:
    body = await object_body(request)
    count, timeout = schemas.parse_fork_body(body, timeout_limit(request))
    results = await manager(request).fork(sid(request), count, timeout, memory=schemas.parse_fork_memory(body))
    out = []
    for r in results:
        if r.row is not None:
            out.append({"sandbox": schemas.sandbox(r.row, envd_version(request), domain(request))})
        else:
            exc = r.error
            body_ = exc.body() if isinstance(exc, KeepStateError) else \
                {"code": 500, "message": f"the fork could not be started: {exc!r}"}
            out.append({"error": body_})
    return web.json_response(out, status=201)


def error_response(exc: KeepStateError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers() or None)
