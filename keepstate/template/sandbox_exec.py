"""Running a build step's command in the build sandbox, and writing a file into it, through its agent.

The same doors a user's SDK uses (the Connect process service, `POST /files`), spoken straight to the agent's
address. Every call opens its own connections and closes them before returning: the builder snapshots the sandbox
right after, and no TCP connection may be open into a sandbox while it is checkpointed (agent_client.py).
"""

from __future__ import annotations

import asyncio
import base64
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from keepstate.ports import AGENT_PORT

TAIL_LINES = 20


@dataclass
class Result:
    exit_code: int
    tail: list[str]  # the last output lines, stdout and stderr interleaved as they came
    error: str | None = None  # the agent refused to start it: "unauthenticated: invalid username: 'x'"


def _headers(token: str, user: str) -> dict[str, str]:
    return {"X-Access-Token": token, "Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


def _run_sync(address: str, token: str, cmd: str, user: str, env: dict[str, str], cwd: str | None,
              on_line: Callable[[str], None]) -> Result:
    from connectrpc.errors import ConnectError
    from protobuf import Oneof
    from pyqwest import SyncClient, SyncHTTPTransport

    from keepstate.agent.proto.process.process_connect import ProcessClientSync
    from keepstate.agent.proto.process.process_pb import ProcessConfig, ProcessEvent, StartRequest

    tail: deque[str] = deque(maxlen=TAIL_LINES)
    pending = {"stdout": b"", "stderr": b""}

    def feed(stream: str, chunk: bytes) -> None:
        buf = pending[stream] + chunk
        *lines, pending[stream] = buf.split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace")
            tail.append(line)
            on_line(line)

    config = ProcessConfig(cmd="/bin/bash", args=["-l", "-c", cmd], envs=dict(env), cwd=cwd) if cwd else \
        ProcessConfig(cmd="/bin/bash", args=["-l", "-c", cmd], envs=dict(env))
    code = -1
    # Our own transport, keeping no idle connection: the shared default one would keep one open into the sandbox
    # for its next snapshot (a connection open at checkpoint time wedges the restored agent).
    transport = SyncHTTPTransport(pool_max_idle_per_host=0, connect_timeout=10.0)
    try:
        with transport, ProcessClientSync(f"http://{address}:{AGENT_PORT}",
                                          http_client=SyncClient(transport)) as client:
            for resp in client.start(StartRequest(process=config, stdin=False), headers=_headers(token, user),
                                     timeout_ms=None):
                match resp.event.event if resp.event else None:
                    case Oneof(field="data", value=ProcessEvent.DataEvent() as data):
                        match data.output:
                            case Oneof(field=("stdout" | "stderr") as name, value=chunk):
                                feed(name, chunk)
                    case Oneof(field="end", value=ProcessEvent.EndEvent() as end):
                        code = end.exit_code
    except ConnectError as exc:
        return Result(-1, list(tail), f"{exc.code.name.lower()}: {exc.message}")
    for stream in ("stdout", "stderr"):
        if pending[stream]:
            feed(stream, b"\n")
    return Result(code, list(tail))


async def run(address: str, token: str, cmd: str, user: str, env: dict[str, str], cwd: str | None,
              on_line: Callable[[str], None]) -> Result:
    """Run `cmd` with bash as `user` and wait for its end; each output line goes to `on_line` (from a thread)."""
    return await asyncio.to_thread(_run_sync, address, token, cmd, user, env, cwd, on_line)


async def write_file(address: str, token: str, path: str, source: Path) -> None:
    """Write `source` to `path` in the sandbox as root (octet-stream upload)."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:
        with open(source, "rb") as f:
            async with http.post(f"http://{address}:{AGENT_PORT}/files", params={"path": path, "username": "root"},
                                 data=f, headers={"X-Access-Token": token,
                                                  "Content-Type": "application/octet-stream"},
                                 timeout=aiohttp.ClientTimeout(total=600)) as r:
                if r.status >= 300:
                    raise RuntimeError(f"writing {path} into the build sandbox failed: {r.status} "
                                       f"{(await r.text())[:300]}")
