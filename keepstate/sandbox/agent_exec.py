"""A command run to its end in a sandbox through its agent's Connect process service, the door a user's SDK uses:
a template build's steps. Called only by AgentClient.run_command (agent_client.py), which counts it as a call,
wakes a frozen sandbox first and refuses it while the sandbox is checkpointed. Every run opens its own connection
and closes it before returning: the builder snapshots the sandbox right after, and no TCP connection may be open
into a sandbox while it is checkpointed.
"""

from __future__ import annotations

import base64
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from keepstate.ports import AGENT_PORT

TAIL_LINES = 20


@dataclass
class Result:
    exit_code: int
    tail: list[str]  # the last output lines, stdout and stderr interleaved as they came
    error: str | None = None  # the agent refused to start it: "unauthenticated: invalid username: 'x'"


def _headers(token: str, user: str) -> dict[str, str]:
    return {"X-Access-Token": token, "Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


def run(address: str, token: str, cmd: str, user: str, env: dict[str, str], cwd: str | None,
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

