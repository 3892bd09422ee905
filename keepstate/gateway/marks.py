"""Checkpoint marks: where in a run's calls a checkpoint was taken, and where a restored run picks up.

Pure functions over positions (no I/O); the rules are in docs/design/gateway.md, "Checkpoint marks".

The gateway learns of a checkpoint only after it is published, when the sandbox has already been thawed (snapshot,
fork) or is gone (pause), so "the calls made so far" is the wrong answer: calls made after the freeze would be
counted. The mark is computed from the times at which each call arrived and was delivered instead, cut at the
freeze. When the caller cannot say exactly when the freeze happened, the mark is a window of positions, and the
restored run's first re-issued call picks the position inside it by its body.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from keepstate.db.repos.ledger import Position

# A restored run that made this many calls without matching its source run has not re-issued anything.
ALIGN_ATTEMPTS = 8


def _arrived(p: Position) -> float:
    return -math.inf if p.arrived_at is None else p.arrived_at  # rows from version 1 files have no times


def _delivered(p: Position) -> float:
    if not p.delivered:
        return math.inf
    return -math.inf if p.delivered_at is None else p.delivered_at


def low_cut(positions: Iterable[Position], t: float) -> int:
    """The lowest position the agent, as it was at time `t`, can make again: the lowest call that had arrived
    by `t` and whose answer had not been delivered by `t`; if none, the next position after those that had
    arrived."""
    arrived = [p for p in positions if _arrived(p) <= t]
    pending = [p.ordinal for p in arrived if _delivered(p) > t]
    if pending:
        return min(pending)
    return max((p.ordinal for p in arrived), default=-1) + 1


def high_cut(positions: Iterable[Position], t: float) -> int:
    """The highest position the agent, as it was at time `t`, can make next: one past the last call that had
    arrived by `t` (a call it was sending at `t` arrives after it)."""
    return max((p.ordinal for p in positions if _arrived(p) <= t), default=-1) + 1


def window(positions: list[Position], frozen_from: float | None, frozen_until: float, floor: int) -> tuple[int, int]:
    """(first, last) positions the agent frozen between `frozen_from` and `frozen_until` makes first on restore.

    Without `frozen_from`, the window starts at `floor` (the start of an earlier mark of the run, or 0)."""
    last = high_cut(positions, frozen_until)
    first = low_cut(positions, frozen_from) if frozen_from is not None else floor
    return min(first, last), last


def align(source: Mapping[int, Position], ordinal: int, body_hash: str, first: int, last: int) -> int | None:
    """The source run's position of a restored run's ordinal 0, found from its call `ordinal`: the lowest offset
    in [first, last] at which the source run made the same call (same body) at `ordinal` calls further; None if
    there is none."""
    for offset in range(first, last + 1):
        p = source.get(offset + ordinal)
        if p is not None and p.body_hash == body_hash:
            return offset
    return None
