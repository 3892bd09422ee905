"""REST handlers for E2B's `/secrets` (shared/docs/e2b-protocol-more.md section 3; the SDK's e2b/secret/).

API key like every control route. A value is accepted by create and update and never rendered: `_info` builds
every response from a SecretRecord, which has no value; error messages name fields, never the value.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from keepstate.clock import rfc3339
from keepstate.db.records import SecretRecord
from keepstate.errors import BadRequest, NotFound
from keepstate.secret import SecretStore
from keepstate.secret.store import DEFAULT_PAGE, MAX_PAGE

from . import schemas
from .keys import SECRETS

routes = web.RouteTableDef()


def store(request: web.Request) -> SecretStore:
    return request.app[SECRETS]


def _info(row: SecretRecord) -> dict[str, Any]:
    return {"secretID": row.secret_id, "name": row.name, "currentVersion": row.current_version,
            "metadata": row.metadata, "createdAt": rfc3339(row.created_at),
            "updatedAt": rfc3339(row.updated_at)}


def _body(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise BadRequest("request body must be a JSON object with `value` (and `name` when creating)")
    return schemas.parse_object(raw)


@routes.post("/secrets")
async def create(request: web.Request) -> web.Response:
    body = _body(await request.read())
    row = await store(request).create(body.get("name"), body.get("value"), body.get("metadata"))
    return web.json_response(_info(row), status=201)


@routes.post("/secrets/{secret_id}")
async def update(request: web.Request) -> web.Response:
    body = _body(await request.read())
    row = await store(request).update(request.match_info["secret_id"], body.get("value"), body.get("metadata"))
    return web.json_response(_info(row))


@routes.get("/secrets/{secret_id}")
async def get_secret(request: web.Request) -> web.Response:
    return web.json_response(_info(await store(request).get(request.match_info["secret_id"])))


@routes.get("/secrets")
async def list_secrets(request: web.Request) -> web.Response:
    limit = schemas.query_int(request.query, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
    rows, token = await store(request).list(limit, request.query.get("nextToken") or None)
    # An empty X-Next-Token ends the SDK's paging (its paginator reads `bool(header)`).
    return web.json_response([_info(r) for r in rows], headers={"X-Next-Token": token or ""})


@routes.delete("/secrets/{secret_id}")
async def delete(request: web.Request) -> web.Response:
    ref = request.match_info["secret_id"]
    if not await store(request).delete(ref):
        raise NotFound(f"secret {ref[:200]} not found")
    return web.Response(status=204)
