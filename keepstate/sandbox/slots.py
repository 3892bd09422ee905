"""Network slots this server holds: claimed from the runtime's host-wide table, released exactly once.

A slot is released only by the holder recorded for it: a teardown that runs twice (a kill noticed twice) must
not free a slot another instance has claimed since, or that instance's network would be torn down under it.
"""

from __future__ import annotations

import logging

from keepstate.errors import Unavailable
from keepstate.runtime.base import SlotTable

log = logging.getLogger("keepstate.sandbox")


class Slots:
    def __init__(self, table: SlotTable, home: str) -> None:
        self.table = table
        self.home = home
        self._held: set[int] = set()

    def alloc(self) -> int:
        for slot in range(1, self.table.max_slots):
            if slot not in self._held and self.table.claim(slot):
                self._held.add(slot)
                return slot
        raise Unavailable("no free network slots on this host")

    def adopt(self, slot: int) -> None:
        """A slot found held by one of our sandboxes after a restart."""
        if slot >= 0:
            self._held.add(slot)

    def bind(self, slot: int, name: str) -> None:
        """Record which instance holds the slot (host-wide), so orphans can be told from the living."""
        self.table.record_owner(slot, self.home, name)

    def ours(self, slot: int, name: str) -> bool:
        """Whether `name` may tear down the slot's network and release it: it is recorded for the slot, or nobody
        holds the slot. A slot another instance is recorded for, or that a live process has claimed and is setting
        an instance up in, is not: a teardown that comes late (a kill noticed twice, a server reaping after a
        crash) must not destroy a neighbour's network."""
        owner = self.table.owner(slot)
        if owner == name:
            return True
        if owner is not None or self.table.held(slot):
            log.warning("slot %d of %s is held by %s now; leaving it", slot, name, owner or "a new claim")
            return False
        return True

    def release(self, slot: int) -> None:
        self.table.release(slot)
        self._held.discard(slot)

    def orphaned(self) -> list[tuple[int, str]]:
        return self.table.orphaned()

    def owned(self) -> list[tuple[int, str]]:
        """Slots recorded for this server's data directory, host-wide: (slot, instance name)."""
        return self.table.owned(self.home)
