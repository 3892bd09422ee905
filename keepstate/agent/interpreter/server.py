"""The HTTP face of the bridge (protocol notes §4): parses requests, streams NDJSON, nothing else.

Routes: POST /execute · GET/POST /contexts · POST /contexts/{id}/restart · DELETE /contexts/{id} ·
GET /health. Errors are JSON `{"code": int, "message": str}` except where the SDK shows the body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from keepstate.agent.interpreter import languages
from keepstate.agent.interpreter.contexts import ContextNotFound, Contexts, Execution
from keepstate.agent.interpreter.envd import Envd, EnvdError, Unauthorized
from keepstate.agent.interpreter.kernel import KernelError
from keepstate.agent.interpreter.output import END, KEEPALIVE, encode

log = logging.getLogger(__name__)

KEEPALIVE_INTERVAL = 5.0

CONTEXTS: web.AppKey[Contexts] = web.AppKey("contexts", Contexts)
ENVD: web.AppKey[Envd] = web.AppKey("envd", Envd)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"code": status, "message": message}, status=status)


async def _body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError as exc:
        raise web.HTTPBadRequest(text=json.dumps({"code": 400, "message": f"invalid JSON body: {exc}"}),
                                 content_type="application/json") from exc
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=json.dumps({"code": 400, "message": "body must be a JSON object"}),
                                 content_type="application/json")
    return body


def _str_map(value: object) -> dict[str, str] | None:
    if value is None:
        return {}
    if isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return dict(value)
    return None


async def health(request: web.Request) -> web.Response:
    return web.json_response("OK")


async def execute(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    code = body.get("code")
    if not isinstance(code, str):
        return _error(400, "`code` must be a string")
    context_id, language = body.get("context_id"), body.get("language")
    if context_id and language:
        return _error(400, "Only one of context_id or language can be provided")
    env_vars = _str_map(body.get("env_vars"))
    if env_vars is None:
        return _error(400, "`env_vars` must be an object of strings")
    try:
        sandbox_envs = await request.app[ENVD].sandbox_envs(request.headers.get("X-Access-Token"))
    except Unauthorized as exc:
        return _error(401, str(exc))
    except EnvdError as exc:
        return _error(503, str(exc))

    contexts = request.app[CONTEXTS]
    try:
        ctx = contexts.get(context_id) if context_id else await contexts.default(language)
        execution = contexts.run(ctx, code, env_vars, sandbox_envs)
    except ContextNotFound as exc:
        return _error(404, exc.message)
    except languages.LanguageError as exc:
        return _error(400, str(exc))
    except KernelError as exc:
        return _error(500, str(exc))
    return await _stream(request, execution)


async def _stream(request: web.Request, execution: Execution) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    finished = False
    try:
        await response.prepare(request)
        while not finished:
            try:
                lines = [await asyncio.wait_for(execution.lines.get(), KEEPALIVE_INTERVAL)]
            except TimeoutError:
                lines = [KEEPALIVE]
            # Whatever else is ready goes in the same write: each send is a syscall, dear under gVisor.
            while lines[-1] is not END and not execution.lines.empty():
                lines.append(execution.lines.get_nowait())
            finished = lines[-1] is END
            await response.write(b"".join(map(encode, lines)))
    finally:
        # Cancelled (client gone, aiohttp handler_cancellation) or the write failed: stop the code.
        if not finished:
            await asyncio.shield(execution.abandon())
    await response.write_eof()
    return response


async def list_contexts(request: web.Request) -> web.Response:
    return web.json_response([c.to_json() for c in await request.app[CONTEXTS].list()])


async def create_context(request: web.Request) -> web.Response:
    body = await _body(request)
    language, cwd = body.get("language"), body.get("cwd")
    if language is not None and not isinstance(language, str):
        return _error(400, "`language` must be a string")
    if cwd is not None and not isinstance(cwd, str):
        return _error(400, "`cwd` must be a string")
    try:
        ctx = await request.app[CONTEXTS].create(language, cwd)
    except languages.LanguageError as exc:
        return _error(400, str(exc))
    except KernelError as exc:
        return _error(500, str(exc))
    return web.json_response(ctx.to_json())


async def restart_context(request: web.Request) -> web.Response:
    try:
        await request.app[CONTEXTS].restart(request.match_info["id"])
    except ContextNotFound as exc:
        return _error(404, exc.message)
    except KernelError as exc:
        return _error(500, str(exc))
    return web.json_response(None)


async def remove_context(request: web.Request) -> web.Response:
    try:
        await request.app[CONTEXTS].remove(request.match_info["id"])
    except ContextNotFound as exc:
        return _error(404, exc.message)
    return web.json_response(None)


def make_app(contexts: Contexts, envd: Envd, default_languages: list[str]) -> web.Application:
    app = web.Application()
    app[CONTEXTS] = contexts
    app[ENVD] = envd
    app.add_routes([
        web.get("/health", health),
        web.post("/execute", execute),
        web.get("/contexts", list_contexts),
        web.post("/contexts", create_context),
        web.post("/contexts/{id}/restart", restart_context),
        web.delete("/contexts/{id}", remove_context),
    ])

    async def lifecycle(app: web.Application) -> Any:
        contexts.start_defaults(default_languages)
        yield
        with contextlib.suppress(Exception):
            await contexts.close()
        await envd.close()

    app.cleanup_ctx.append(lifecycle)
    return app
