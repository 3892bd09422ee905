"""A sandbox's log lines: a view of its causal history (docs/design/sandbox-logs.md).

Pure: `entry` turns one event into one log entry and `select` picks the entries a query asks for; the API reads the
events (keepstate/api/logs.py).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .event import Event

LEVELS = ("debug", "info", "warn", "error")
_RANK = {level: i for i, level in enumerate(LEVELS)}


@dataclass(frozen=True)
class LogEntry:
    ts: float  # seconds since the epoch
    seq: int  # the event's: orders entries of one millisecond
    level: str
    message: str
    fields: dict[str, str]

    @property
    def ms(self) -> int:
        return int(self.ts * 1000)

    def to_json(self) -> dict[str, Any]:
        return {"timestamp": timestamp(self.ts), "level": self.level, "message": self.message,
                "fields": self.fields}


def timestamp(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)


def _command(data: dict[str, Any]) -> str:
    args = data.get("args")
    if not isinstance(args, list):
        args = []
    return " ".join(shlex.quote(str(part)) for part in [data.get("cmd", "?"), *args])


def _says(kind: str, d: dict[str, Any]) -> tuple[str, str]:
    """(level, message) of one event kind."""
    match kind:
        case "sandbox.create":
            return "info", f"sandbox created from template {d.get('template_id')}"
        case "sandbox.connect":
            return "info", f"connected (timeout {d.get('timeout')} s)"
        case "sandbox.timeout.set":
            return "info", f"timeout set to {d.get('timeout')} s"
        case "sandbox.refresh":
            return "info", f"kept alive for {d.get('duration')} s more"
        case "sandbox.pause":
            return "info", f"paused (checkpoint {d.get('checkpoint_id')})"
        case "sandbox.resume":
            return "info", f"resumed from checkpoint {d.get('checkpoint_id')} ({d.get('from', 'store')})"
        case "sandbox.kill":
            reason = d.get("reason", "kill")
            if reason == "died":
                return "error", "sandbox died: its instance is gone (out of memory or a crash)"
            return "info", f"sandbox killed ({reason})"
        case "checkpoint":
            return "info", f"checkpoint {d.get('checkpoint_id')} taken ({d.get('kind')})"
        case "checkpoint.failed":
            return "error", f"checkpoint {d.get('checkpoint_id')} failed: {d.get('error')}"
        case "fork.child":
            return "info", f"forked into sandbox {d.get('child_session')}"
        case "session.fork":
            return "info", (f"forked from sandbox {d.get('parent_session')} "
                            f"at checkpoint {d.get('parent_checkpoint_id')}")
        case "server.adopt":
            return "info", "a restarted server took the sandbox over"
        case "journal.gap":
            return "warn", f"{d.get('lost')} agent journal entries were lost before they could be recorded"
        case "journal.reset":
            return "warn", "the agent restarted: its journal began again"
        case "process.start":
            return "info", f"process {d.get('pid')} started: {_command(d)}"
        case "process.exit":
            code = d.get("exitCode")
            return ("info" if code == 0 else "warn"), f"process {d.get('pid')} exited with code {code}"
        case "process.output":
            if d.get("truncated"):
                return "debug", f"process {d.get('pid')}: further output not logged"
            return "debug", str(d.get("text", ""))
        case "file.write":
            return "debug", f"wrote {d.get('path')} ({d.get('size')} bytes)"
        case "file.remove":
            return "debug", f"removed {d.get('path')}"
        case "file.move":
            return "debug", f"moved {d.get('source')} to {d.get('destination')}"
        case "dir.make":
            return "debug", f"made directory {d.get('path')}"
    return "info", kind


def entry(event: Event) -> LogEntry:
    level, message = _says(event.kind, event.data)
    agent_ts = event.data.get("agent_ts")
    ts = float(agent_ts) if isinstance(agent_ts, int | float) and not isinstance(agent_ts, bool) else event.ts
    fields = {"kind": event.kind, "seq": str(event.seq)}
    fields.update((k, _text(v)) for k, v in event.data.items() if k not in fields)
    return LogEntry(ts, event.seq, level, message, fields)


def select(events: Iterable[Event], *, cursor_ms: int | None = None, backward: bool = False, level: str | None = None,
           search: str | None = None, limit: int = 1000) -> list[LogEntry]:
    """Entries at or after `cursor_ms` oldest first, or (`backward`) at or before it newest first; at `level` or
    above; whose message contains `search`; at most `limit`."""
    lowest = _RANK[level] if level else 0
    chosen = [e for e in map(entry, events)
              if _RANK[e.level] >= lowest and (not search or search in e.message)
              and (cursor_ms is None or (e.ms <= cursor_ms if backward else e.ms >= cursor_ms))]
    chosen.sort(key=lambda e: (e.ms, e.seq), reverse=backward)
    return chosen[:limit]
