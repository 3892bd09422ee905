"""The journal: an in-memory, bounded, numbered log of what was done in the sandbox through the agent.

The host polls it (`GET /journal?after=<seq>&limit=<n>`) to build the session's causal history. It lives only in the
agent's memory on purpose: a checkpoint of the sandbox carries it, so a restored or forked sandbox continues the same
sequence. Entries: `process.start`, `process.output` (the first lines, bounded), `process.exit`, `file.write`,
`file.remove`, `file.move`, `dir.make`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CAPACITY = 10_000
DEFAULT_LIMIT = 1000


class JournalQueryError(ValueError):
    """A `/journal` query the agent refuses (not an integer, negative, ...)."""


@dataclass(frozen=True)
class JournalEntry:
    seq: int
    ts: float
    kind: str
    data: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "ts": self.ts, "kind": self.kind, "data": self.data}


class Journal:
    def __init__(self, capacity: int = CAPACITY, clock: Callable[[], float] = time.time) -> None:
        self._entries: deque[JournalEntry] = deque(maxlen=capacity)
        self._last = 0
        self._clock = clock

    @property
    def last(self) -> int:
        return self._last

    @property
    def oldest(self) -> int:
        """Seq of the oldest entry still held; `last + 1` when empty, so "oldest > after + 1" always means a gap."""
        return self._entries[0].seq if self._entries else self._last + 1

    def append(self, kind: str, data: dict[str, Any]) -> int:
        self._last += 1
        self._entries.append(JournalEntry(self._last, round(self._clock(), 6), kind, data))
        return self._last

    def read(self, after: int, limit: int = DEFAULT_LIMIT) -> list[JournalEntry]:
        """Entries with seq > `after`, oldest first, at most `limit`."""
        if limit <= 0 or after >= self._last:
            return []
        # Seqs are dense, so the first wanted entry's index follows from the oldest held one.
        start = max(0, after + 1 - self.oldest)
        out: list[JournalEntry] = []
        for i in range(start, min(len(self._entries), start + limit)):
            out.append(self._entries[i])
        return out

    def page(self, after: int, limit: int = DEFAULT_LIMIT) -> dict[str, Any]:
        """The `/journal` response. `next` is the cursor for the following call: the last seq returned, else
        `min(after, last)` (a cursor beyond `last` means the caller saw another journal, e.g. a fresh sandbox)."""
        events = self.read(after, limit)
        nxt = events[-1].seq if events else min(max(after, 0), self._last)
        return {"events": [e.to_json() for e in events], "next": nxt, "oldest": self.oldest, "last": self._last}


def parse_query(q: dict[str, str], capacity: int = CAPACITY) -> tuple[int, int]:
    """`after` (default 0) and `limit` (default 1000, at most the capacity) from a query string."""
    def integer(name: str, default: int) -> int:
        raw = q.get(name)
        if raw is None or raw == "":
            return default
        try:
            value = int(raw)
        except ValueError:
            raise JournalQueryError(f"'{name}' must be an integer, got '{raw}'") from None
        if value < 0:
            raise JournalQueryError(f"'{name}' must not be negative, got {value}")
        return value

    return integer("after", 0), min(integer("limit", DEFAULT_LIMIT), capacity)
