"""The runtime seam: what a sandbox engine must do, whatever isolates the sandbox.

gVisor (`runsc`, runtime/gvisor.py) implements it; keepstate.testing.FakeRuntime implements it in-process for
fast lifecycle tests (tests/runtime/test_conformance.py runs one suite against both); a microVM runtime can
implement the same operations later without the API, the store or the agent changing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from keepstate.ports import AGENT_PORT


@dataclass(frozen=True)
class Limits:
    """Resource limits enforced by the host (cgroups), not by the sandbox."""

    cpu: float = 2.0
    memory_mb: int = 512
    pids: int = 1024
    # The writable layer's disk quota (docs/design/sandbox-disk.md); 0: the layer lives in memory, as for
    # sandboxes (and their checkpoints) from before the disk.
    disk_mb: int = 0


@dataclass(frozen=True)
class TemplateRoot:
    """A built template as the runtime needs it: a read-only root and its identity."""

    template_id: str
    digest: str
    rootfs: Path


@dataclass(frozen=True)
class Mount:
    """A host directory bind-mounted read-write into the sandbox at `destination` (a volume,
    docs/design/volumes.md). Not part of a checkpoint image: a restore must be given the same mounts."""

    source: Path
    destination: str


@dataclass
class SandboxSpec:
    """What to start. `name` is the runtime-level name, unique on this host."""

    name: str
    template: TemplateRoot
    limits: Limits
    hostname: str = "sandbox"
    mounts: tuple[Mount, ...] = ()


@dataclass
class Endpoint:
    """How the host reaches a sandbox: its address and the agent's port.

    This is the exec channel: the agent inside serves processes and files on it.
    """

    address: str
    agent_port: int = AGENT_PORT

    def url(self, port: int | None = None) -> str:
        return f"http://{self.address}:{port or self.agent_port}"


@dataclass(frozen=True)
class Handle:
    """A sandbox as the runtime knows it: its name and network slot, which the catalog persists so a new
    server can re-adopt it. `endpoint` is filled in by create and restore."""

    name: str
    slot: int
    endpoint: Endpoint | None = None


@dataclass(frozen=True)
class Leftover:
    """Something of an instance still on the host (docs/design/teardown.md): its `kind` (for gVisor "container",
    "cgroup", "netns", "veth", "loop", "shm", "state", "slot"), the instance's name, and where it is."""

    kind: str
    name: str
    where: str


class RuntimeFailure(Exception):
    """A runtime operation failed; the message says what and how to fix it."""


class SlotTable(Protocol):
    """Network slots, claimed host-wide (several servers may share a host); a slot records which instance holds it,
    so a server can reap the instances of a data directory that is gone (runtime/network.py for gVisor)."""

    @property
    def max_slots(self) -> int: ...

    def claim(self, slot: int) -> bool:
        """Claim a free slot; False if another holds it."""

    def record_owner(self, slot: int, home: str, name: str) -> None: ...

    def owner(self, slot: int) -> str | None:
        """The instance recorded for a slot, or None (free, or claimed and not yet recorded)."""

    def held(self, slot: int) -> bool:
        """Whether the slot is claimed: an instance is recorded for it, or a live process has claimed it and is
        setting an instance up there (a claim by a process that died holds nothing)."""

    def release(self, slot: int) -> None: ...

    def orphaned(self) -> list[tuple[int, str]]:
        """(slot, instance name) of every slot whose data directory is gone."""

    def owned(self, home: str) -> list[tuple[int, str]]:
        """(slot, instance name) of every slot recorded for the data directory `home`."""


class Runtime(Protocol):
    """A sandbox engine. Instances are named (unique on the host) and sit in a network slot; every method is
    blocking (the sandbox package calls them from worker threads) and raises RuntimeFailure on failure.

    Instance states, as `state` and `statuses` report them: "running" (an idle-frozen one too), "paused" (frozen),
    "gone" (no such instance), "unknown" (its state could not be read: alive, as far as anyone may conclude), or
    another word of the engine's for an instance on its way out (e.g. "stopped")."""

    @property
    def kind(self) -> str: ...

    @property
    def release(self) -> str:
        """The engine's release: a checkpoint restores only on the same one."""

    @property
    def slots(self) -> SlotTable: ...

    def prepare(self, open_ports: tuple[int, ...] = ()) -> None:
        """Host set-up before the first sandbox (firewall rules); idempotent."""

    def create(self, spec: SandboxSpec, slot: int) -> Handle:
        """Start a sandbox in network slot `slot`; return once its root process runs (not yet its agent)."""

    def state(self, name: str) -> str:
        """One instance's state (see the class docstring)."""

    def is_alive(self, handle: Handle) -> bool:
        """Running, frozen or unknown."""

    def checkpoint(self, handle: Handle, image_dir: Path, leave_running: bool = True) -> None:
        """Write a consistent image of memory, processes and files into image_dir. A frozen sandbox stays frozen.
        No connection may be open into the sandbox meanwhile (gVisor's restored agent wedges on one)."""

    def freeze(self, handle: Handle) -> None:
        """Stop every task of the sandbox where it is, holding its memory (a standby for a quick thaw)."""

    def thaw(self, handle: Handle) -> None:
        """Let a frozen sandbox run on from exactly where it was frozen."""

    def idle_freeze(self, handle: Handle) -> None:
        """Stop the sandbox's host processes altogether while it is idle, so that it costs no CPU
        (docs/design/idle.md); quick (the caller may be an event loop). Unlike `freeze`, the instance's state stays
        "running"; nothing may reach it until `idle_thaw`, and no connection may be open into it meanwhile."""

    def idle_thaw(self, handle: Handle) -> None:
        """Undo `idle_freeze`; quick and idempotent (a no-op on an instance that is not frozen or is gone)."""

    def idle_frozen(self, handle: Handle) -> bool:
        """Whether `idle_freeze` holds the instance."""

    def export_files(self, handle: Handle, dest: Path) -> int:
        """Write a running sandbox's files, as changes against its template (the tar a filesystem-only pause keeps,
        docs/design/sandbox-disk.md), into `dest`, by a process of the runtime's own inside it, not through its
        agent (which may be why it is being rebooted); return the bytes written. Every other process of the
        sandbox is stopped meanwhile. RuntimeFailure if it is frozen or gone, or the export fails."""

    def restore(self, spec: SandboxSpec, image_dir: Path, slot: int) -> Handle:
        """Start a new sandbox, in network slot `slot`, from an image written by checkpoint()."""

    def destroy(self, handle: Handle) -> None:
        """Stop the sandbox and release everything it held but its slot claim (the caller releases it once this
        returned and `remains` is empty); idempotent; RuntimeFailure naming what is left if it could not. A slot of
        -1 leaves the network alone."""

    def remains(self, handle: Handle) -> list[Leftover]:
        """What of one instance exists on the host (its slot claim aside): empty once `destroy` finished."""

    def inventory(self, home: Path) -> list[Leftover]:
        """What of the data directory `home`'s instances exists on the host, running ones included, their slot
        claims too: empty once every sandbox of it is gone and torn down."""

    def cgroup_stats(self, handle: Handle) -> dict[str, int]:
        """Real figures from the host's cgroups: cpu_ns, mem_used, mem_cache, mem_limit; {} if it has none."""

    def statuses(self) -> dict[str, str]:
        """Every sandbox of this runtime on the host, by name, with its state (for re-adoption)."""


def host_cpu_flags() -> list[str]:
    """CPU feature flags of this host: a memory image may use any of them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(line.split(":", 1)[1].split())
    except OSError:
        pass
    return []
