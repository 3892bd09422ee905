"""The gateway: each configured server a stdio MCP client session, their tools merged behind one Streamable-HTTP
MCP server that requires the bearer token (docs/design/mcp-gateway.md, "Tools")."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import subprocess
from collections.abc import Callable
from typing import Any, TextIO

import mcp_types as types
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.server.lowlevel.server import Server
from mcp.shared.exceptions import MCPError
from mcp_types.jsonrpc import CONNECTION_CLOSED

from keepstate.agent.asgi import header, send_json

from .config import ServerSpec

log = logging.getLogger("mcp-gateway")
START_TIMEOUT = 45.0  # seconds a server may take to start and list its tools
Scope = dict[str, Any]


class BackendError(RuntimeError):
    pass


class Backend:
    """One server: its process and client session live in a task of their own (the SDK's transports are anyio
    task groups, entered and left by one task)."""

    def __init__(self, spec: ServerSpec, errlog: TextIO) -> None:
        self.spec = spec
        self.errlog = errlog
        self.session: ClientSession | None = None
        self.tools: list[types.Tool] = []
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._ready: asyncio.Future[None] | None = None

    async def start(self) -> None:
        await asyncio.to_thread(self._prepare)
        self._stop = asyncio.Event()
        self._ready = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(), name=f"mcp-server-{self.spec.name}")
        try:
            async with asyncio.timeout(START_TIMEOUT):
                await asyncio.shield(self._ready)
        except TimeoutError:
            await self.close()
            raise BackendError(f"server '{self.spec.name}' did not start in {START_TIMEOUT:.0f} s") from None

    def _prepare(self) -> None:
        """A GitHub server: its clone and install, once."""
        spec = self.spec
        if spec.clone is None or spec.cwd is None or os.path.isdir(spec.cwd):
            return
        os.makedirs(os.path.dirname(spec.cwd), exist_ok=True)
        for argv, cwd in ((["git", "clone", "--depth", "1", spec.clone, spec.cwd], None),
                          (["/bin/sh", "-c", spec.install], spec.cwd) if spec.install else (None, None)):
            if argv is None:
                continue
            done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600,
                                  env={**os.environ, **spec.env})
            if done.returncode != 0:
                raise BackendError(f"server '{spec.name}': `{' '.join(argv)}` failed ({done.returncode}): "
                                   f"{(done.stderr or done.stdout).strip()[-500:]}")

    async def _run(self) -> None:
        assert self._ready is not None
        spec = self.spec
        params = StdioServerParameters(command=spec.command, args=spec.args, env=spec.env or None, cwd=spec.cwd)
        try:
            async with stdio_client(params, errlog=self.errlog) as (read, write), \
                    ClientSession(read, write) as session:
                await session.initialize()
                tools: list[types.Tool] = []
                cursor: str | None = None
                while True:
                    page = await session.list_tools(
                        params=types.PaginatedRequestParams(cursor=cursor) if cursor else None)
                    tools += page.tools
                    cursor = page.next_cursor
                    if not cursor:
                        break
                self.session, self.tools = session, tools
                self._ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(BackendError(f"server '{spec.name}' ({spec.command}) failed to start: "
                                                       f"{type(exc).__name__}: {exc}"))
            elif not isinstance(exc, asyncio.CancelledError):
                log.warning("server '%s' ended: %s", spec.name, exc)
        finally:
            self.session = None

    async def call(self, name: str, arguments: dict[str, Any] | None) -> types.CallToolResult:
        """Call a tool of this server. One that went away is started again: before the call when it is known
        gone, after it when the call found it so (that call is an error)."""
        for attempt in (1, 2):
            session = self.session
            if session is None:
                if attempt == 2:
                    break
                await self.close()
                await self.start()
                continue
            try:
                result = await session.call_tool(name, arguments)
            except Exception as exc:
                if isinstance(exc, MCPError) and exc.code != CONNECTION_CLOSED:
                    raise  # the server's own answer
                # The transport broke: the process is gone. This call is lost (it may have been what ended it);
                # the next one finds the server started again.
                log.warning("server '%s' went away during a call (%s); starting it again", self.spec.name, exc)
                await self.close()
                await self.start()
                raise MCPError(types.INTERNAL_ERROR, f"server '{self.spec.name}' ended during the call "
                                                     "(it is started again)") from exc
            assert isinstance(result, types.CallToolResult)
            return result
        raise MCPError(types.INTERNAL_ERROR, f"server '{self.spec.name}' is not running and did not start again")

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(BaseException):
                async with asyncio.timeout(10):
                    await self._task
            if not self._task.done():
                self._task.cancel()
            self._task = None


def route_tools(backends: list[Backend]) -> dict[str, tuple[Backend, types.Tool, str]]:
    """Exposed name → (server, the tool as listed, its name on the server). A name two servers share is
    `<server>__<tool>` for each."""
    seen: dict[str, int] = {}
    for b in backends:
        for t in b.tools:
            seen[t.name] = seen.get(t.name, 0) + 1
    routes: dict[str, tuple[Backend, types.Tool, str]] = {}
    for b in backends:
        prefix = b.spec.name.replace("/", "_")
        for t in b.tools:
            name = t.name if seen[t.name] == 1 else f"{prefix}__{t.name}"
            routes[name] = (b, t.model_copy(update={"name": name}), t.name)
    return routes


def make_server(backends: list[Backend]) -> Server[Any]:
    routes = route_tools(backends)

    async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[tool for _, tool, _ in routes.values()])

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        found = routes.get(params.name)
        if found is None:
            raise MCPError(types.INVALID_PARAMS, f"no tool '{params.name}' on this gateway")
        backend, _, original = found
        return await backend.call(original, params.arguments)

    return Server("keepstate-mcp-gateway", on_list_tools=list_tools, on_call_tool=call_tool)


class RequireToken:
    """Every request but `GET /health` needs `Authorization: Bearer <token>`; else a 401."""

    def __init__(self, app: Callable[..., Any], token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "http":
            if scope["path"] == "/health":
                await send_json(send, 200, {"status": "ok"})
                return
            given = (header(scope, "authorization") or "").encode("latin-1")
            if not hmac.compare_digest(given, self.expected):
                await send_json(send, 401, {"error": "unauthorized",
                                            "message": "this MCP gateway needs `Authorization: Bearer <token>` "
                                                       "(the sandbox's get_mcp_token())"})
                return
        await self.app(scope, receive, send)


async def serve(specs: list[ServerSpec], token: str, host: str, port: int, errlog: TextIO) -> None:
    """Start every server (all of them, or none: a failure stops those started), then serve until cancelled."""
    import uvicorn

    backends = [Backend(spec, errlog) for spec in specs]
    started: list[Backend] = []
    try:
        for b in backends:
            await b.start()
            started.append(b)
            log.info("server '%s' started: %d tools", b.spec.name, len(b.tools))
        app = RequireToken(make_server(backends).streamable_http_app(host=host), token)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
        await uvicorn.Server(config).serve()
    finally:
        for b in started:
            await b.close()
