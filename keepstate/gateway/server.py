"""The gateway's HTTP surface: parse requests into CallRequests, render Answers, errors in the provider's shape."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from keepstate.db.engine import Database
from keepstate.db.errors import DatabaseUnavailable
from keepstate.gateway import errors, providers
from keepstate.gateway.config import GatewayConfig
from keepstate.gateway.errors import GatewayError
from keepstate.gateway.gateway import Answer, CallRequest, Gateway

GATEWAY = web.AppKey("keepstate_gateway", Gateway)
MAX_BODY = 64 * 1024 * 1024


def create_app(config: GatewayConfig, db: Database, gateway: Gateway | None = None) -> web.Application:
    """The gateway as an aiohttp application on the process's Database (which the application does not close);
    `app[GATEWAY]` is its Gateway (register_run, budgets...)."""
    gw = gateway or Gateway(config, db)
    app = web.Application(client_max_size=MAX_BODY)
    app[GATEWAY] = gw

    async def on_startup(_: web.Application) -> None:
        await gw.start()

    async def on_cleanup(_: web.Application) -> None:
        await gw.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    for path, endpoint in (
        ("/v1/chat/completions", "chat"),
        ("/v1/responses", "responses"),
        ("/v1/embeddings", "embeddings"),
        ("/v1/messages", "messages"),
    ):
        app.router.add_post(path, _handler(endpoint))
    app.router.add_get("/v1/models", _models)
    app.router.add_route("*", "/v1/{tail:.*}", _not_found)
    return app


def _token(request: web.Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def error_response(e: GatewayError, flavour: str) -> web.Response:
    return web.Response(status=e.status, body=e.body(flavour), content_type="application/json", headers=e.headers)


def _handler(endpoint: str) -> Any:
    flavour = providers.flavour(endpoint)

    async def handle(request: web.Request) -> web.StreamResponse:
        gw = request.app[GATEWAY]
        token = _token(request)
        try:
            caller = await gw.caller_waiting(token, request.remote)
            raw = await request.read()
            body = _parse(raw)
            req = CallRequest(token, endpoint, body, raw, {k.lower(): v for k, v in request.headers.items()},
                              request.remote)
            answer = await gw.begin(req, caller)
        except GatewayError as e:
            return error_response(e, flavour)
        except DatabaseUnavailable as e:
            return error_response(errors.database_unavailable(str(e)), flavour)
        return await _send(request, gw, answer, flavour, req.stream)

    return handle


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise errors.invalid(f"We could not parse the JSON body of your request: {e}") from None
    if not isinstance(body, dict):
        raise errors.invalid("The request body must be a JSON object.")
    return body


def _headers(answer: Answer, flavour: str, request_id: str | None) -> dict[str, str]:
    h = {"x-keepstate-call-key": answer.call_key, "x-keepstate-source": answer.source}
    if request_id:
        h["request-id" if flavour == "anthropic" else "x-request-id"] = request_id
    return h


async def _send(request: web.Request, gw: Gateway, answer: Answer, flavour: str, stream: bool) -> web.StreamResponse:
    if answer.chunks is not None:
        return await _write_whole(request, gw, answer, flavour, answer.status, answer.content_type,
                                  b"".join(answer.chunks), answer.request_id)
    live = answer.live
    assert live is not None
    await live.wait_headers()
    if live.error is not None:
        return error_response(live.error, flavour)
    assert live.status is not None
    if not (stream and live.status == 200):
        async for _ in live.follow():
            pass
        if live.error is not None:
            return error_response(live.error, flavour)
        return await _write_whole(request, gw, answer, flavour, live.status, live.content_type or "application/json",
                                  live.body(), live.request_id)
    resp = web.StreamResponse(status=200, headers=_headers(answer, flavour, live.request_id))
    resp.content_type = "text/event-stream"
    resp.headers["cache-control"] = "no-cache"
    try:
        await resp.prepare(request)
        async for chunk in live.follow():
            await resp.write(chunk)
        if live.broken:
            # The upstream stream broke: cut the client off too, so its SDK raises instead of ending quietly.
            if request.transport is not None:
                request.transport.abort()
            return resp
        await resp.write_eof()
    except ConnectionError:
        return resp  # the client left; the upstream call goes on and is stored
    gw.delivered(answer)
    return resp


async def _write_whole(
    request: web.Request, gw: Gateway, answer: Answer, flavour: str, status: int, content_type: str, body: bytes,
    request_id: str | None,
) -> web.StreamResponse:
    resp = web.StreamResponse(status=status, headers=_headers(answer, flavour, request_id))
    resp.headers["content-type"] = content_type
    resp.content_length = len(body)
    try:
        await resp.prepare(request)
        await resp.write(body)
        await resp.write_eof()
    except ConnectionError:
        return resp
    gw.delivered(answer)
    return resp


async def _models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    anthropic = "anthropic-version" in request.headers
    try:
        await gw.authenticate_waiting(_token(request), request.remote)
    except GatewayError as e:
        return error_response(e, "anthropic" if anthropic else "openai")
    except DatabaseUnavailable as e:
        return error_response(errors.database_unavailable(str(e)), "anthropic" if anthropic else "openai")
    if anthropic:
        ids = gw.listed_models("anthropic")
        data: list[dict[str, Any]] = [
            {"type": "model", "id": m, "display_name": m, "created_at": "1970-01-01T00:00:00Z"} for m in ids
        ]
        doc: dict[str, Any] = {"data": data, "has_more": False, "first_id": ids[0] if ids else None,
                               "last_id": ids[-1] if ids else None}
    else:
        doc = {"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": p.name}
            for p in gw.config.providers if p.kind == "openai" for m in p.listed_models()
        ]}
    return web.json_response(doc)


async def _not_found(request: web.Request) -> web.Response:
    flavour = "anthropic" if "anthropic-version" in request.headers else "openai"
    return error_response(GatewayError(404, "not_found", f"Unknown path {request.method} {request.path}"), flavour)
