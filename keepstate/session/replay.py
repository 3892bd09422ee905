"""Replay: re-run a causal history's recorded actions in a fresh sandbox and report divergences.

Pure: `plan()` turns events into steps and `Replayer` runs them through an `Executor`; neither touches a socket.
What replay means is specified in docs/design/causal-history.md, section "Replay".
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, TypedDict

from .event import Event

Outcome = Literal["match", "diverged", "skipped", "not_replayable", "abandoned"]


class Executor(Protocol):
    """Where replayed actions run: a fresh sandbox of the session's template."""

    def run(self, cmd: str, args: list[str], cwd: str | None, user: str | None, envs: dict[str, str]) -> int:
        """Run to completion and return the exit code."""
        ...

    def write(self, path: str, data: bytes, user: str | None) -> None:
        ...


@dataclass(frozen=True)
class Step:
    """One replayable action, or one that is not replayed (`reason` says why)."""

    session_id: str
    seq: int
    kind: str  # the event kind it came from
    action: Literal["run", "write", "none"]
    cmd: str = ""
    args: tuple[str, ...] = ()
    cwd: str | None = None
    user: str | None = None
    envs: dict[str, str] = field(default_factory=dict)
    expected_exit: int | None = None
    path: str | None = None
    content: bytes | None = None
    skip: Outcome | None = None
    reason: str = ""

    def describe(self) -> str:
        if self.action == "run":
            return " ".join([self.cmd, *self.args])[:200]
        return f"{self.kind} {self.path or ''}".strip()


class _StepOrigin(TypedDict):
    """The fields every step shares with the event it came from."""

    session_id: str
    seq: int
    kind: str


class _RunFields(TypedDict):
    """A recorded process.start's command, as `Step` fields."""

    cmd: str
    args: tuple[str, ...]
    cwd: str | None
    user: str | None
    envs: dict[str, str]


class _ResultOrigin(TypedDict):
    """The fields a result copies from its step."""

    session_id: str
    seq: int
    kind: str
    action: str


@dataclass(frozen=True)
class StepResult:
    session_id: str
    seq: int
    kind: str
    outcome: Outcome
    action: str
    expected: int | None = None
    got: int | None = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ReplayReport:
    results: list[StepResult]

    @property
    def ok(self) -> bool:
        return not any(r.outcome == "diverged" for r in self.results)

    @property
    def divergences(self) -> list[StepResult]:
        return [r for r in self.results if r.outcome == "diverged"]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            out[r.outcome] = out.get(r.outcome, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "counts": self.counts(), "results": [r.to_dict() for r in self.results]}


def _abandoned(events: Sequence[Event]) -> set[int]:
    """Indexes of events on abandoned branches: recorded after a checkpoint that a later resume went back to."""
    where: dict[str, int] = {}
    out: set[int] = set()
    for i, ev in enumerate(events):
        if ev.kind == "checkpoint" and isinstance(ev.data.get("checkpoint_id"), str):
            where[ev.data["checkpoint_id"]] = i
        elif ev.kind == "sandbox.resume":
            at = where.get(str(ev.data.get("checkpoint_id")))
            if at is not None:
                out.update(range(at + 1, i))
    return out


def _str_list(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value) if isinstance(value, list) else ()


def plan(events: Sequence[Event]) -> list[Step]:
    """The steps of a replay, in history order, each either replayable or carrying the reason it is not."""
    dropped = _abandoned(events)
    exits: dict[int, dict[str, Any]] = {}  # index of process.start -> its process.exit data
    open_pids: dict[tuple[str, Any], int] = {}
    for i, ev in enumerate(events):
        if i in dropped:
            continue
        key = (ev.session_id, ev.data.get("pid"))
        if ev.kind == "process.start":
            open_pids[key] = i
        elif ev.kind == "process.exit" and key in open_pids:
            exits[open_pids.pop(key)] = ev.data
        elif ev.kind == "session.fork":
            # the child continues the parent's processes: carry the parent's open pids over
            parent = str(ev.data.get("parent_session"))
            for (sid, pid), idx in list(open_pids.items()):
                if sid == parent:
                    open_pids[(ev.session_id, pid)] = idx

    steps: list[Step] = []
    for i, ev in enumerate(events):
        base: _StepOrigin = {"session_id": ev.session_id, "seq": ev.seq, "kind": ev.kind}
        d = ev.data
        user = d.get("user") if isinstance(d.get("user"), str) else None
        if ev.kind not in ("process.start", "file.write", "file.remove", "file.move", "dir.make"):
            continue
        if i in dropped:
            steps.append(Step(**base, action="none", skip="abandoned",
                              reason="recorded after a checkpoint that a later resume went back to"))
            continue
        if ev.kind == "process.start":
            run: _RunFields = {"cmd": str(d.get("cmd", "")), "args": _str_list(d.get("args")),
                   "cwd": d.get("cwd") or None, "user": user,
                   "envs": {str(k): str(v) for k, v in (d.get("envs") or {}).items()}}
            exit_data = exits.get(i)
            if d.get("pty"):
                steps.append(Step(**base, action="none", **run, skip="skipped",
                                  reason="PTY process: its interactive input is not recorded"))
            elif exit_data is None:
                steps.append(Step(**base, action="none", **run, skip="skipped",
                                  reason="no recorded exit (still running, or the session ended first)"))
            elif not isinstance(exit_data.get("exitCode"), int) or exit_data["exitCode"] < 0 or \
                    "signal" in str(exit_data.get("status", "")):
                steps.append(Step(**base, action="none", **run, skip="skipped",
                                  reason=f"ended by a signal ({exit_data.get('status')}): its end came from outside"))
            else:
                steps.append(Step(**base, action="run", **run, expected_exit=int(exit_data["exitCode"])))
        elif ev.kind == "file.write":
            path = str(d.get("path", ""))
            raw = d.get("content_b64")
            content: bytes | None = None
            if isinstance(raw, str):
                try:
                    content = base64.b64decode(raw, validate=True)
                except (binascii.Error, ValueError):
                    content = None
            if content is None:
                steps.append(Step(**base, action="none", path=path, user=user, skip="not_replayable",
                                  reason="the written content was not recorded"))
            else:
                steps.append(Step(**base, action="write", path=path, user=user, content=content))
        elif ev.kind == "dir.make":
            steps.append(Step(**base, action="run", cmd="mkdir", args=("-p", str(d.get("path", ""))), user=user,
                              expected_exit=0, path=str(d.get("path", ""))))
        elif ev.kind == "file.remove":
            steps.append(Step(**base, action="run", cmd="rm", args=("-rf", str(d.get("path", ""))), user=user,
                              expected_exit=0, path=str(d.get("path", ""))))
        elif ev.kind == "file.move":
            steps.append(Step(**base, action="run", cmd="mv", args=(str(d.get("source", "")),
                                                                    str(d.get("destination", ""))),
                              user=user, expected_exit=0, path=str(d.get("source", ""))))
    return steps


class Replayer:
    """Runs a history's steps in order through an executor and compares outcomes with the recorded ones."""

    def __init__(self, executor: Executor, *, stop_on_divergence: bool = False) -> None:
        self.executor = executor
        self.stop_on_divergence = stop_on_divergence

    def replay(self, events: Sequence[Event]) -> ReplayReport:
        results: list[StepResult] = []
        for step in plan(events):
            result = self._one(step)
            results.append(result)
            if result.outcome == "diverged" and self.stop_on_divergence:
                break
        return ReplayReport(results)

    def _one(self, step: Step) -> StepResult:
        base: _ResultOrigin = {"session_id": step.session_id, "seq": step.seq, "kind": step.kind,
                               "action": step.action}
        if step.skip is not None:
            return StepResult(**base, outcome=step.skip, detail=f"{step.describe()}: {step.reason}")
        try:
            if step.action == "write":
                assert step.path is not None and step.content is not None
                self.executor.write(step.path, step.content, step.user)
                return StepResult(**base, outcome="match", detail=f"wrote {len(step.content)} bytes to {step.path}")
            got = self.executor.run(step.cmd, list(step.args), step.cwd, step.user, step.envs)
        except Exception as exc:  # any executor failure is a finding about this step, not the end of the replay
            return StepResult(**base, outcome="diverged", expected=step.expected_exit,
                              detail=f"{step.describe()}: executor failed: {type(exc).__name__}: {exc}")
        outcome: Outcome = "match" if got == step.expected_exit else "diverged"
        detail = step.describe() if outcome == "match" else \
            f"{step.describe()}: exit code {got}, recorded {step.expected_exit}"
        return StepResult(**base, outcome=outcome, expected=step.expected_exit, got=got, detail=detail)
