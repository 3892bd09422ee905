"""Verification of a chain of events: pure, so it runs the same on stored rows, exports and golden files."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from .event import GENESIS, Event, canonical


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    checked: int
    first_bad_seq: int | None = None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StoredEvent:
    """An event as read from storage, with `data` still in its stored text (so non-canonical edits show)."""

    session_id: str
    seq: int
    ts: float
    kind: str
    data_text: str
    prev: str
    hash: str


def verify_chain(session_id: str, rows: Iterable[StoredEvent], head: tuple[int, str] | None = None) -> VerifyResult:
    """Check seq continuity, session, canonical data, links and hashes; then that `head` names the last event.

    `rows` must be in seq order. `head` is the stored (seq, hash) of the last event, or None when not known
    (an export).
    """
    expected_prev = GENESIS
    checked = 0
    last: StoredEvent | None = None
    for row in rows:
        want = checked + 1
        if row.seq != want:
            return VerifyResult(False, checked, want, f"event {want} is missing (found seq {row.seq} next)")
        if row.session_id != session_id:
            return VerifyResult(False, checked, want, f"event {want} names session {row.session_id!r}")
        try:
            data = json.loads(row.data_text)
        except json.JSONDecodeError as exc:
            return VerifyResult(False, checked, want, f"event {want}: data is not JSON ({exc.msg})")
        if not isinstance(data, dict):
            return VerifyResult(False, checked, want, f"event {want}: data is not a JSON object")
        if canonical(data).decode() != row.data_text:
            return VerifyResult(False, checked, want, f"event {want}: data is not in canonical form (edited)")
        if row.prev != expected_prev:
            return VerifyResult(False, checked, want, f"event {want}: prev does not match the hash of event {want - 1}")
        ev = Event(row.session_id, row.seq, row.ts, row.kind, data, row.prev, row.hash)
        if ev.computed_hash() != row.hash:
            return VerifyResult(False, checked, want, f"event {want}: hash does not match its content")
        expected_prev = row.hash
        checked += 1
        last = row
    if head is not None and (head[0] > 0 or last is not None):
        head_seq, head_hash = head
        if last is not None and head_seq < last.seq:
            return VerifyResult(False, checked, head_seq + 1, f"event {head_seq + 1} is after the recorded head")
        if last is None or head_seq != last.seq:
            return VerifyResult(False, checked, checked + 1,
                                f"chain ends at seq {checked} but its recorded head is seq {head_seq} (truncated)")
        if head_hash != last.hash:
            return VerifyResult(False, checked, last.seq, f"event {last.seq}: hash differs from the recorded head")
    return VerifyResult(True, checked)


def stored(ev: Event) -> StoredEvent:
    return StoredEvent(ev.session_id, ev.seq, ev.ts, ev.kind, canonical(ev.data).decode(), ev.prev, ev.hash)


def verify_events(session_id: str, events: Iterable[Event]) -> VerifyResult:
    """Verify parsed events (an export or a golden file)."""
    return verify_chain(session_id, (stored(e) for e in events))
