"""What the Process API streams about a process: its start, its output and its end as `ProcessEvent`s, and a wait
status rendered as Go's `ProcessState` renders it (envd is Go: the SDKs show its words)."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Literal, TypeAlias, cast

from protobuf import Oneof

from keepstate.agent.proto.process.process_pb import ProcessEvent

_GO_SIGNAL_NAMES: dict[int, str] = {
    signal.SIGHUP: "hangup", signal.SIGINT: "interrupt", signal.SIGQUIT: "quit", signal.SIGILL: "illegal instruction",
    signal.SIGTRAP: "trace/breakpoint trap", signal.SIGABRT: "aborted", signal.SIGBUS: "bus error",
    signal.SIGFPE: "floating point exception", signal.SIGKILL: "killed", signal.SIGUSR1: "user defined signal 1",
    signal.SIGSEGV: "segmentation fault", signal.SIGUSR2: "user defined signal 2", signal.SIGPIPE: "broken pipe",
    signal.SIGALRM: "alarm clock", signal.SIGTERM: "terminated",
}


@dataclass(frozen=True)
class ExitInfo:
    exit_code: int
    exited: bool
    status: str
    error: str | None


def exit_info(wait_status: int) -> ExitInfo:
    """Go's `ProcessState` rendering of a wait status: "exit status 1", "signal: killed"."""
    if os.WIFEXITED(wait_status):
        code = os.WEXITSTATUS(wait_status)
        text = f"exit status {code}"
        return ExitInfo(code, True, text, text if code else None)
    sig = os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else 0
    text = f"signal: {_GO_SIGNAL_NAMES.get(sig, f'signal {sig}')}"
    return ExitInfo(-1, False, text, text)


# The generated messages type a oneof as a union with one Oneof[Literal[field], value] per field, and mypy infers
# Oneof("start", ...) as Oneof[str, ...] when the expected type is that union: each Oneof below is given its
# member type first.
_DataOutput: TypeAlias = (Oneof[Literal["stdout"], bytes] | Oneof[Literal["stderr"], bytes]
                          | Oneof[Literal["pty"], bytes])


def start_event(pid: int) -> ProcessEvent:
    event: Oneof[Literal["start"], ProcessEvent.StartEvent] = Oneof("start", ProcessEvent.StartEvent(pid=pid))
    return ProcessEvent(event=event)


def data_event(kind: str, data: bytes) -> ProcessEvent:
    output = cast(_DataOutput, Oneof(kind, data))  # kind is one of the three: "stdout", "stderr" or "pty"
    event: Oneof[Literal["data"], ProcessEvent.DataEvent] = Oneof("data", ProcessEvent.DataEvent(output=output))
    return ProcessEvent(event=event)


def end_event(info: ExitInfo) -> ProcessEvent:
    end = ProcessEvent.EndEvent(exit_code=info.exit_code, exited=info.exited, status=info.status)
    if info.error is not None:
        end.error = info.error
    event: Oneof[Literal["end"], ProcessEvent.EndEvent] = Oneof("end", end)
    return ProcessEvent(event=event)


_KEEPALIVE: Oneof[Literal["keepalive"], ProcessEvent.KeepAlive] = Oneof("keepalive", ProcessEvent.KeepAlive())
KEEPALIVE_EVENT = ProcessEvent(event=_KEEPALIVE)
