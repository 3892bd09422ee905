"""The event: one recorded fact of a session, hash-chained to its predecessor.

The canonical encoding and hash are specified in docs/design/causal-history.md; anything that changes them is a
new format version.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

GENESIS = "0" * 64
FIELDS = ("session_id", "seq", "ts", "kind", "data", "prev", "hash")


def canonical(value: Any) -> bytes:
    """Sorted keys, no spaces, UTF-8: the bytes that get hashed (and the stored form of `data`)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def event_hash(session_id: str, seq: int, ts: float, kind: str, data: dict[str, Any], prev: str) -> str:
    body = {"session_id": session_id, "seq": seq, "ts": ts, "kind": kind, "data": data, "prev": prev}
    return hashlib.sha256(canonical(body)).hexdigest()


@dataclass(frozen=True)
class Event:
    session_id: str
    seq: int
    ts: float
    kind: str
    data: dict[str, Any]
    prev: str
    hash: str

    @classmethod
    def make(cls, session_id: str, seq: int, ts: float, kind: str, data: dict[str, Any], prev: str) -> Event:
        return cls(session_id, seq, ts, kind, data, prev, event_hash(session_id, seq, ts, kind, data, prev))

    def computed_hash(self) -> str:
        return event_hash(self.session_id, self.seq, self.ts, self.kind, self.data, self.prev)

    def to_dict(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "seq": self.seq, "ts": self.ts, "kind": self.kind,
                "data": self.data, "prev": self.prev, "hash": self.hash}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Event:
        """Parse an exported event; raises ValueError naming the field that is missing or of the wrong type."""
        if not isinstance(d, dict):
            raise ValueError(f"an event must be a JSON object, got {type(d).__name__}")
        missing = [f for f in FIELDS if f not in d]
        if missing:
            raise ValueError(f"event lacks field(s) {', '.join(missing)}")
        checks: list[tuple[str, type | tuple[type, ...]]] = [
            ("session_id", str), ("seq", int), ("ts", (int, float)), ("kind", str), ("data", dict), ("prev", str),
            ("hash", str)]
        for name, typ in checks:
            if not isinstance(d[name], typ) or isinstance(d[name], bool):
                raise ValueError(f"event field {name!r} has type {type(d[name]).__name__}")
        return cls(d["session_id"], d["seq"], float(d["ts"]), d["kind"], d["data"], d["prev"], d["hash"])
