"""A late teardown (a kill noticed twice, a reap after a crash) must not destroy a neighbour's network."""

from __future__ import annotations

from keepstate.sandbox.slots import Slots
from keepstate.testing.fake_runtime import FakeSlots


def test_only_the_recorded_instance_or_nobody_may_tear_a_slot_down() -> None:
    table = FakeSlots()
    mine, theirs = Slots(table, "/home/a"), Slots(table, "/home/b")
    slot = mine.alloc()
    mine.bind(slot, "ks-mine")
    assert mine.ours(slot, "ks-mine") and not mine.ours(slot, "ks-gone")
    mine.release(slot)
    assert mine.ours(slot, "ks-mine")  # free: nothing of anyone's to harm
    assert table.claim(slot)  # another server claims it and is starting an instance there, not yet named
    assert not mine.ours(slot, "ks-mine")
    theirs.bind(slot, "ks-theirs")
    assert not mine.ours(slot, "ks-mine") and theirs.ours(slot, "ks-theirs")
