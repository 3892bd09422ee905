"""What tests assert is empty once a data directory's sandboxes are gone: everything of them still on the host
(runsc containers, cgroups, network namespaces and veths, slots, loop devices, /dev/shm folders, state folders;
docs/design/teardown.md)."""

from __future__ import annotations

from pathlib import Path

from keepstate.runtime.base import Leftover, Runtime


def leftovers(home: Path | str, runtime: Runtime | None = None) -> list[Leftover]:
    """Every leftover of the data directory `home`'s instances. `runtime`: the one its server ran on (a FakeRuntime
    knows its instances only in memory); by default gVisor's for `home`."""
    if runtime is None:
        from keepstate.runtime.gvisor import GVisorRuntime

        runtime = GVisorRuntime(Path(home) / "sandboxes")
    return runtime.inventory(Path(home))
