"""Teardown on real gVisor sandboxes (docs/design/teardown.md): whatever state a sandbox is in, destroying it
leaves nothing on the host (`keepstate.testing.leftovers`), ten at once included, and a teardown that fails is
retried until it finishes."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from keepstate.db.setup import prepare
from keepstate.db.url import default_url
from keepstate.runtime import cgroups
from keepstate.runtime.base import Handle, Limits, RuntimeFailure, SandboxSpec, TemplateRoot
from keepstate.runtime.gvisor import CGROUP_PARENT, GVisorRuntime
from keepstate.sandbox.rows import SandboxRows
from keepstate.sandbox.slots import Slots
from keepstate.sandbox.teardowns import Teardowns
from keepstate.testing import leftovers

from ..sandbox.conftest import gvisor_unavailable
from .test_conformance import wait_agent


@dataclass
class Host:
    runtime: GVisorRuntime
    root: TemplateRoot
    home: Path
    slots: Slots

    def start(self, disk_mb: int = 0) -> Handle:
        slot = self.slots.alloc()
        name = "ks-td-" + secrets.token_hex(4)
        self.slots.bind(slot, name)
        handle = self.runtime.create(SandboxSpec(name, self.root, Limits(1, 256, disk_mb=disk_mb)), slot)
        wait_agent(handle)
        return handle


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    why = gvisor_unavailable()
    if why:
        pytest.skip(why)
    from keepstate.template import builder

    built = builder.latest("base")
    assert built is not None
    # tmp_path exists: a live data directory, so no server on this host takes its instances for orphans
    runtime = GVisorRuntime(tmp_path / "sandboxes")
    runtime.prepare()
    h = Host(runtime, TemplateRoot(built.name, built.digest, built.rootfs), tmp_path,
             Slots(runtime.slots, str(tmp_path)))
    yield h
    for lo in leftovers(tmp_path):  # whatever a failing test left
        slot = int(lo.where.rsplit("/", 1)[1]) if lo.kind == "slot" else -1
        runtime.destroy(Handle(lo.name, slot))
        if slot >= 0:
            h.slots.release(slot)


def release(host: Host, handle: Handle) -> None:
    assert host.runtime.remains(handle) == []
    host.slots.release(handle.slot)


def test_destroying_a_running_sandbox_with_a_disk_leaves_nothing(host: Host) -> None:
    handle = host.start(disk_mb=256)
    kinds = {lo.kind for lo in leftovers(host.home) if lo.name == handle.name}
    assert {"container", "cgroup", "netns", "veth", "loop", "state", "slot"} <= kinds
    host.runtime.destroy(handle)
    release(host, handle)
    assert leftovers(host.home) == []


def test_destroying_a_sandbox_frozen_in_its_cgroup_leaves_nothing(host: Host) -> None:
    """Its processes stuck in a frozen cgroup (v1 freezer, frozen by hand as an idle-freezing host would): the
    kills are delivered once it is thawed, after they were sent."""
    handle = host.start()
    freezer = Path("/sys/fs/cgroup/freezer") / CGROUP_PARENT / handle.name
    (freezer / "freezer.state").write_text("FROZEN")
    assert (freezer / "freezer.state").read_text().strip() in ("FROZEN", "FREEZING")
    assert cgroups.pids([freezer])
    host.runtime.destroy(handle)
    release(host, handle)
    assert leftovers(host.home) == []


def test_destroying_a_paused_sandbox_leaves_nothing(host: Host) -> None:
    handle = host.start()
    host.runtime.freeze(handle)  # runsc pause: a standby
    host.runtime.destroy(handle)
    release(host, handle)
    assert leftovers(host.home) == []


def test_ten_destroyed_at_once_leave_nothing(host: Host) -> None:
    handles = [host.start() for _ in range(10)]
    with ThreadPoolExecutor(10) as pool:
        list(pool.map(host.runtime.destroy, handles))
    for handle in handles:
        release(host, handle)
    assert leftovers(host.home) == []


class FailingOnce(GVisorRuntime):
    """gVisor whose first destroy fails before doing anything (as one whose runsc timed out would)."""

    failed = 0

    def destroy(self, handle: Handle) -> None:
        if not self.failed:
            self.failed += 1
            raise RuntimeFailure(f"injected failure of the destroy of {handle.name}")
        super().destroy(handle)


async def test_a_failed_teardown_is_retried_until_nothing_is_left(host: Host) -> None:
    handle = host.start()
    runtime = FailingOnce(host.runtime.state_dir)
    db = await prepare(default_url(host.home), host.home)
    rows = SandboxRows(db)
    teardowns = Teardowns(rows, runtime, host.slots)
    try:
        assert not await teardowns.run(handle.name, handle.slot)
        [rec] = await rows.teardowns()
        assert rec.attempts == 1 and "injected" in rec.last_error and teardowns.pending() == 1
        assert host.runtime.slots.owner(handle.slot) == handle.name  # its network is not gone: the slot stays held
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while teardowns.pending():
            assert loop.time() < deadline, "the teardown was not retried"
            await asyncio.sleep(0.05)
        # Released: no longer this sandbox's. (Not asserted free: slots are the host's, and another test's server
        # may claim it the moment it is released, as one did in a fresh-clone run.)
        assert await rows.teardowns() == [] and host.runtime.slots.owner(handle.slot) != handle.name
        assert leftovers(host.home) == []
    finally:
        await teardowns.stop()
        await db.close()


def test_what_a_create_that_timed_out_leaves_is_torn_down(host: Host) -> None:
    """A `runsc run` killed by its timeout under load left its lock file alone in the runsc root (seen with 100
    sandboxes): no state for `runsc delete` to work from, yet the inventory sees it and destroy removes it."""
    name = "ks-td-" + secrets.token_hex(4)
    (host.runtime.state_dir / name).mkdir(parents=True)
    lock = host.runtime.root / f"{name}_sandbox:{name}.lock"
    lock.touch()
    assert {(lo.kind, lo.where) for lo in leftovers(host.home)} == {("container", str(lock)),
                                                                    ("state", str(host.runtime.state_dir / name))}
    host.runtime.destroy(Handle(name, -1))
    assert leftovers(host.home) == []
