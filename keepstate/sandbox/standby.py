"""Standbys: paused sandboxes kept frozen in memory for a while, so that resuming one is a thaw, not a restore.

A standby is exactly its checkpoint's state, so a resume from it and one from the store continue from the same
point. Which to release is decided here (pure); the manager releases them under each sandbox's lock.
"""

from __future__ import annotations

from .record import Instance


class StandbyCache:
    def __init__(self, seconds: float = 300, mb: int = 2048) -> None:
        self.seconds = seconds
        self.mb = mb
        self._held: dict[str, Instance] = {}  # by sandbox ID

    @property
    def enabled(self) -> bool:
        return self.seconds > 0

    def add(self, sandbox_id: str, instance: Instance) -> None:
        self._held[sandbox_id] = instance

    def discard(self, sandbox_id: str) -> None:
        self._held.pop(sandbox_id, None)

    def __contains__(self, sandbox_id: object) -> bool:
        return sandbox_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def ids(self) -> list[str]:
        return list(self._held)

    def due(self, now: float) -> list[tuple[str, str]]:
        """(sandbox ID, why) of the standbys to release: older than `seconds`, then the oldest until the rest fit
        in `mb`."""
        total = sum(sb.mem for sb in self._held.values())
        out = []
        for sandbox_id, sb in sorted(self._held.items(), key=lambda kv: kv[1].since):
            if now - sb.since >= self.seconds:
                why = f"paused for {self.seconds:g} s"
            elif total > self.mb << 20:
                why = f"standbys hold more than {self.mb} MiB"
            else:
                continue
            total -= sb.mem
            out.append((sandbox_id, why))
        return out
