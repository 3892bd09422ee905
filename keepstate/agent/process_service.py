"""The `process.Process` Connect service."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from keepstate.agent.permissions import PermissionDenied, check_enter, for_user
from keepstate.agent.process import ManagedProcess, ProcessError, ProcessTable, SpawnSpec
from keepstate.agent.process_events import KEEPALIVE_EVENT, start_event
from keepstate.agent.proto.process.process_connect import Process
from keepstate.agent.proto.process.process_pb import (
    CloseStdinRequest,
    CloseStdinResponse,
    ConnectRequest,
    ConnectResponse,
    ListRequest,
    ListResponse,
    ProcessConfig,
    ProcessEvent,
    ProcessSelector,
    SendInputRequest,
    SendInputResponse,
    SendSignalRequest,
    SendSignalResponse,
    Signal,
    StartRequest,
    StartResponse,
    StreamInputRequest,
    StreamInputResponse,
    UpdateRequest,
    UpdateResponse,
)
from keepstate.agent.rpc_context import (
    deadline_at,
    deadline_exceeded,
    keepalive_interval,
    request_path,
    request_user,
)
from keepstate.agent.settings import SandboxSettings
from keepstate.agent.users import User, process_env, resolve_path

# An agent told to listen for sudo elsewhere (host-mode tests) tells the sudo clients it starts, too.
_SUDO_ENV = {k: v for k in ("KEEPSTATE_SUDO_SOCKET",) if (v := os.environ.get(k))}
_CODES = {"not_found": Code.NOT_FOUND, "invalid_argument": Code.INVALID_ARGUMENT, "internal": Code.INTERNAL}
_SIGNALS = {Signal.SIGKILL: signal.SIGKILL, Signal.SIGTERM: signal.SIGTERM}


def command_env(settings: SandboxSettings, user: User, request_env: dict[str, str]) -> dict[str, str]:
    """A command's environment: the user's, the sandbox's, then the request's."""
    return process_env(user, {**_SUDO_ENV, **settings.env_vars}, request_env)


def command_defaults(settings: SandboxSettings, user: User) -> tuple[dict[str, str], str]:
    """The environment and working directory of a command that names neither (what a login spare is made for)."""
    return command_env(settings, user, {}), resolve_path("", user, settings.default_workdir)


def _connect_error(e: ProcessError) -> ConnectError:
    return ConnectError(_CODES.get(e.code, Code.INTERNAL), str(e))


async def _event_stream(
    proc: ManagedProcess, queue: asyncio.Queue[ProcessEvent | None], keepalive_s: float, deadline: float | None,
    kills: bool = False,
) -> AsyncIterator[ProcessEvent]:
    """start first, then live events; a keepalive whenever `keepalive_s` pass without one.

    At `deadline` (event-loop time, from the request's Connect-Timeout-Ms) the stream ends with deadline_exceeded,
    as envd's do (connect-go ends a stream so when its handler's context expires). The SDK counts on it: its async
    client stops enforcing the deadline itself once the stream is open. `kills` says the deadline is also the
    process's (Start): the process is SIGKILLed then, and nothing that comes after that kill (its end event above
    all) is sent instead, whichever of the two timers the loop happens to run first."""
    loop = asyncio.get_running_loop()
    try:
        yield start_event(proc.pid)
        while True:
            wait = keepalive_s
            if deadline is not None:
                left = deadline - loop.time()
                if left <= 0:
                    raise deadline_exceeded()
                wait = min(wait, left)
            try:
                event = await asyncio.wait_for(queue.get(), wait)
            except TimeoutError:
                if wait == keepalive_s:
                    yield KEEPALIVE_EVENT
                continue  # else the deadline: checked above, against the clock
            if event is None:
                return
            if kills and proc.expired:
                raise deadline_exceeded()
            yield event
    finally:
        proc.unsubscribe(queue)  # a disconnected client just stops listening; the process runs on


class ProcessService(Process):
    def __init__(self, settings: SandboxSettings, table: ProcessTable) -> None:
        self._settings = settings
        self._table = table

    def _select(self, selector: ProcessSelector | None) -> ManagedProcess:
        match selector.selector if selector is not None else None:
            case Oneof(field="pid", value=int() as pid):
                return self._table.get(pid=pid)
            case Oneof(field="tag", value=str() as tag):
                return self._table.get(tag=tag)
        raise ConnectError(Code.INVALID_ARGUMENT, "process selector (pid or tag) is required")

    def _find(self, selector: ProcessSelector | None) -> ManagedProcess:
        try:
            return self._select(selector)
        except ProcessError as e:
            raise _connect_error(e) from None

    def _spawn(self, request: StartRequest, ctx: Any, deadline: float | None) -> ManagedProcess:
        config = request.process or ProcessConfig()
        if not config.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is required")
        user = request_user(self._settings, ctx)
        cwd = request_path(self._settings, config.cwd if config.has_field("cwd") else "", user)
        if not os.path.isdir(cwd):
            raise ConnectError(Code.INVALID_ARGUMENT, f"cwd '{cwd}' does not exist")
        try:
            # The child changes directory before it drops to the user: check as the user would be checked.
            check_enter(cwd, for_user(user.name, user.uid, user.gid))
        except PermissionDenied as e:
            raise ConnectError(Code.PERMISSION_DENIED, str(e)) from None
        pty_size = None
        if request.has_field("pty"):
            size = request.pty.size if request.pty is not None else None
            pty_size = (size.cols or 80, size.rows or 24) if size is not None else (80, 24)
        spec = SpawnSpec(
            cmd=config.cmd,
            args=list(config.args),
            env=command_env(self._settings, user, dict(config.envs)),
            cwd=cwd,
            user=user,
            # Older SDKs never send `stdin` and expect a pipe: absent means true.
            stdin=pty_size is None and (request.stdin if request.has_field("stdin") else True),
            pty_size=pty_size,
            tag=request.tag if request.has_field("tag") else None,
            config=config,
        )
        try:
            return self._table.start(spec, deadline)
        except ProcessError as e:
            raise _connect_error(e) from None

    async def start(self, request: StartRequest, ctx: Any) -> AsyncIterator[StartResponse]:
        deadline = deadline_at(ctx, asyncio.get_running_loop().time())
        proc = self._spawn(request, ctx, deadline)
        queue = proc.subscribe()
        async for event in _event_stream(proc, queue, keepalive_interval(ctx), deadline, kills=True):
            yield StartResponse(event=event)

    async def connect(self, request: ConnectRequest, ctx: Any) -> AsyncIterator[ConnectResponse]:
        # This stream's deadline is its own: when it passes the stream ends, the process runs on (as with envd).
        deadline = deadline_at(ctx, asyncio.get_running_loop().time())
        proc = self._find(request.process)
        queue = proc.subscribe()
        async for event in _event_stream(proc, queue, keepalive_interval(ctx), deadline):
            yield ConnectResponse(event=event)

    async def list(self, request: ListRequest, ctx: Any) -> ListResponse:
        return ListResponse(processes=[p.info() for p in self._table.running()])

    async def send_input(self, request: SendInputRequest, ctx: Any) -> SendInputResponse:
        proc = self._find(request.process)
        await self._write(proc, request.input)
        return SendInputResponse()

    async def _write(self, proc: ManagedProcess, data: Any) -> None:
        match data.input if data is not None else None:
            case Oneof(field=kind, value=payload):
                try:
                    await proc.write_input(kind, payload)
                except ProcessError as e:
                    raise _connect_error(e) from None
            case _:
                raise ConnectError(Code.INVALID_ARGUMENT, "input (stdin or pty) is required")

    async def stream_input(
        self, request: AsyncIterator[StreamInputRequest], ctx: Any
    ) -> StreamInputResponse:
        proc: ManagedProcess | None = None
        async for message in request:
            match message.event:
                case Oneof(field="start", value=StreamInputRequest.StartEvent() as start):
                    proc = self._find(start.process)
                case Oneof(field="data", value=StreamInputRequest.DataEvent() as data):
                    if proc is None:
                        raise ConnectError(Code.FAILED_PRECONDITION, "first message must be a start event")
                    await self._write(proc, data.input)
                case _:
                    continue  # keepalive
        return StreamInputResponse()

    async def send_signal(self, request: SendSignalRequest, ctx: Any) -> SendSignalResponse:
        proc = self._find(request.process)
        sig = _SIGNALS.get(request.signal)
        if sig is None:
            raise ConnectError(Code.UNIMPLEMENTED, f"signal {request.signal!r} is not supported")
        proc.signal(sig)
        return SendSignalResponse()

    async def close_stdin(self, request: CloseStdinRequest, ctx: Any) -> CloseStdinResponse:
        proc = self._find(request.process)
        try:
            proc.close_stdin()
        except ProcessError as e:
            raise _connect_error(e) from None
        return CloseStdinResponse()

    async def update(self, request: UpdateRequest, ctx: Any) -> UpdateResponse:
        proc = self._find(request.process)
        if request.has_field("pty") and request.pty is not None and request.pty.size is not None:
            try:
                proc.resize(request.pty.size.cols, request.pty.size.rows)
            except ProcessError as e:
                raise _connect_error(e) from None
        return UpdateResponse()
