"""The agent's ASGI application: plain HTTP routes, token checks, and the two Connect services.

Routing and auth live here; the work is in `files_http`, `process_service` and `filesystem_service`.
Connect machinery (connectrpc, protobuf) is imported at start-up, before the agent reports healthy: a pooled
sandbox is then fully warm when it is handed out, and the first command pays no imports (about 11 MB more per
idle agent).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

from keepstate.agent import ENVD_VERSION
from keepstate.agent.asgi import (
    HTTPError,
    Message,
    Receive,
    Scope,
    Send,
    header,
    query,
    read_body,
    send_empty,
    send_error,
    send_json,
)
from keepstate.agent.auth import UNAUTHORIZED_MESSAGE, token_ok
from keepstate.agent.journal import Journal, JournalQueryError, parse_query
from keepstate.agent.reaper import REAPER
from keepstate.agent.resumable import Streams, stream_id
from keepstate.agent.settings import SandboxSettings, SettingsError, parse_init

log = logging.getLogger("keepstate.agent")

_CORS = [
    (b"access-control-allow-origin", b"*"),
    (b"access-control-expose-headers", b"*"),
]
_PREFLIGHT = _CORS + [
    (b"access-control-allow-methods", b"GET, POST, PUT, DELETE, OPTIONS"),
    (b"access-control-allow-headers", b"*"),
    (b"access-control-max-age", b"7200"),
]


class AgentApp:
    def __init__(self, settings: SandboxSettings) -> None:
        self.settings = settings
        self.journal = Journal()
        self._rpc: dict[str, Any] | None = None
        self._process_table: Any = None
        self._filesystem: Any = None
        self._supervisor: Any = None
        self._metrics: Any = None
        self._sudo: Any = None
        self._idle: Any = None
        self.streams = Streams()

    # --- lazily built parts -----------------------------------------------------------------------------------
    def rpc_apps(self) -> dict[str, Any]:
        if self._rpc is None:
            from keepstate.agent.filesystem_service import FilesystemService
            from keepstate.agent.process import SETPRIV, ProcessTable, setpriv
            from keepstate.agent.process_service import ProcessService, command_defaults
            from keepstate.agent.proto.filesystem.filesystem_connect import FilesystemASGIApplication
            from keepstate.agent.proto.process.process_connect import ProcessASGIApplication
            from keepstate.agent.spare import Spares

            settings = self.settings
            spares = Spares(setpriv() or [SETPRIV], defaults=lambda user: command_defaults(settings, user))
            self._process_table = ProcessTable(journal=self.journal, spares=spares)
            self._filesystem = FilesystemService(self.settings, self.journal)
            process_app = ProcessASGIApplication(ProcessService(self.settings, self._process_table))
            fs_app = FilesystemASGIApplication(self._filesystem)
            self._rpc = {process_app.path + "/": process_app, fs_app.path + "/": fs_app}
        return self._rpc

    # --- ASGI -------------------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        sid = stream_id(scope)
        if sid is not None:  # the host router's: a stream it can pick up again after a snapshot cut it
            try:
                await self.streams.serve(sid, scope, receive, send, self._handle)
            except HTTPError as e:
                await send_error(send, e.status, e.message)
            return
        await self._handle(scope, receive, send)

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def send_with_cors(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers", []))
                if _CORS[0] not in headers:  # a resumed stream's answer has them already
                    headers += _CORS
                message["headers"] = headers
            await send(message)

        try:
            await self._route(scope, receive, send_with_cors)
        except HTTPError as e:
            if started:
                raise
            await send_error(send_with_cors, e.status, e.message)
        except Exception as e:
            # Every error a client sees is JSON with an int code; the traceback goes to our log.
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            await send_error(send_with_cors, 500, f"internal error: {e}")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                from keepstate.agent.mounts import mount_volumes

                mount_volumes()  # before anything can look at them
                REAPER.install(asyncio.get_running_loop())
                self._start_sudo()
                self.rpc_apps()
                if self.settings.template.services:
                    from keepstate.agent.services import Supervisor

                    self._supervisor = Supervisor(self.settings)
                    self._supervisor.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.streams.close()
                if self._supervisor is not None:
                    await self._supervisor.stop()
                if self._process_table is not None:
                    self._process_table.kill_all()
                if self._filesystem is not None:
                    self._filesystem.close()
                if self._sudo is not None:
                    self._sudo.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _start_sudo(self) -> None:
        if os.geteuid() != 0:
            return  # only root can run commands as someone else
        from keepstate.agent.sudo_server import SudoServer, socket_path

        server = SudoServer(socket_path(), lambda: self.settings.default_user, self.journal)
        try:
            server.start(asyncio.get_running_loop())
        except OSError as e:
            log.warning("sudo relay unavailable: cannot listen on %s: %s", server.path, e)
            return
        self._sudo = server

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        if method == "OPTIONS":
            await send({"type": "http.response.start", "status": 204, "headers": _PREFLIGHT})
            await send({"type": "http.response.body", "body": b""})
            return
        if path == "/health" and method in ("GET", "HEAD"):
            await send_empty(send, 204)
            return
        if path == "/files":
            from keepstate.agent import files_http

            if method == "GET":
                await files_http.download(scope, receive, send, self.settings)
                return
            if method == "POST":
                await files_http.upload(scope, receive, send, self.settings, self.journal)
                return
            raise HTTPError(405, f"method {method} not allowed on /files")
        # Everything below needs the access token (once /init has set one).
        if not token_ok(self.settings.access_token, header(scope, "x-access-token")):
            raise HTTPError(401, UNAUTHORIZED_MESSAGE)
        if path == "/init" and method == "POST":
            await self._init(receive, send)
            return
        if path == "/envs" and method == "GET":
            await send_json(send, 200, self.settings.env_vars)
            return
        if path == "/metrics" and method == "GET":
            if self._metrics is None:
                from keepstate.agent.metrics import MetricsSampler

                self._metrics = MetricsSampler()
            await send_json(send, 200, self._metrics.sample())
            return
        if path == "/journal" and method == "GET":
            try:
                after, limit = parse_query(query(scope))
            except JournalQueryError as e:
                raise HTTPError(400, str(e)) from None
            await send_json(send, 200, self.journal.page(after, limit))
            return
        if path == "/keepstate/idle" and method == "GET":
            await send_json(send, 200, self._idle_probe().look())
            return
        if path == "/keepstate/listening" and method == "GET":
            from keepstate.agent import listening  # asked before each checkpoint: the host's

            await send_json(send, 200, {"ports": listening.read()})
            return
        if path == "/keepstate/files" and method in ("GET", "PUT"):
            from keepstate.agent import files_archive  # a filesystem-only pause and its resume: the host's

            if method == "GET":
                await files_archive.export(send, stop=query(scope).get("stop", "1") != "0")
            else:
                await files_archive.apply(receive, send)
            return
        if path.startswith("/keepstate/streams/") and method == "POST":
            try:
                offset = int(query(scope).get("offset", "0"))
            except ValueError:
                raise HTTPError(400, "offset must be an integer") from None
            await self.streams.resume(path.rsplit("/", 1)[1], offset, receive, send)
            return
        if path == "/version" and method == "GET":
            await send_json(send, 200, {"version": ENVD_VERSION})
            return
        if path.startswith("/process.Process/") or path.startswith("/filesystem.Filesystem/"):
            prefix = path[: path.index("/", 1) + 1]
            await self.rpc_apps()[prefix](scope, receive, send)
            return
        raise HTTPError(404, f"no route for {method} {path}")

    def _idle_probe(self) -> Any:
        if self._idle is None:
            from keepstate.agent.idle import IdleProbe

            self._idle = IdleProbe(self._busy, self._own_pids, lambda: self.journal.last)
        return self._idle

    def _busy(self) -> str:
        """Why the agent itself is not idle: a command or PTY runs, a watcher collects events ("" if neither)."""
        if self._process_table is not None and self._process_table.running():
            return "a command runs"
        if self._filesystem is not None and self._filesystem.watching():
            return "a watcher collects events"
        return ""

    def _own_pids(self) -> set[int]:
        """The agent's spares and template services (their descendants are the agent's too)."""
        pids: set[int] = set()
        if self._process_table is not None and self._process_table.spares is not None:
            pids |= self._process_table.spares.pids()
        if self._supervisor is not None:
            pids |= self._supervisor.pids()
        return pids

    async def _init(self, receive: Receive, send: Send) -> None:
        body = await read_body(receive, 1 << 20)
        try:
            init = parse_init(json.loads(body) if body.strip() else {})
        except (ValueError, SettingsError) as e:
            raise HTTPError(400, f"invalid /init body: {e}") from None
        self.settings.apply(init)
        await send_empty(send, 204)
        # The host calls /init right before handing the sandbox out: warm the RPC machinery now, off the
        # request path, so the first command does not pay for the imports.
        asyncio.get_running_loop().call_soon(self._warm)

    def _warm(self) -> None:
        """The RPC machinery built, and a spare process (spare.py) waiting as the default user."""
        self.rpc_apps()
        from keepstate.agent.users import UnknownUser, lookup_user

        table = self._process_table
        if table is None or table.spares is None:
            return
        try:
            user = lookup_user(self.settings.default_user)
        except UnknownUser:
            return
        table.spares.prime(user)
