"""The runtime seam: what a sandbox engine must do, whatever isolates the sandbox.

gVisor (`runsc`) implements it today; a microVM runtime can implement the same five
operations later without the API, the store or the agent changing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class Limits:
    """Resource limits enforced by the host (cgroups), not by the sandbox."""

    cpu: float = 2.0
    memory_mb: int = 512
    pids: int = 1024


@dataclass(frozen=True)
class TemplateRoot:
    """A built template as the runtime needs it: a read-only root and its identity."""

    template_id: str
    digest: str
    rootfs: Path


@dataclass
class SandboxSpec:
    """What to start. `name` is the runtime-level name, unique on this host."""

    name: str
    template: TemplateRoot
    limits: Limits
    hostname: str = "sandbox"


@dataclass
class Endpoint:
    """How the host reaches a sandbox: its address and the agent's port.

    This is the exec channel: the agent inside serves processes and files on it.
    """

    address: str
    agent_port: int = 49983

    def url(self, port: int | None = None) -> str:
        return f"http://{self.address}:{port or self.agent_port}"


@dataclass(frozen=True)
class Handle:
    """A sandbox as the runtime knows it: its name and network slot, which the catalog persists so a new
    server can re-adopt it. `endpoint` is filled in by create and restore."""

    name: str
    slot: int
    endpoint: Endpoint | None = None


class RuntimeFailure(Exception):
    """A runtime operation failed; the message says what and how to fix it."""


class Runtime(Protocol):
    kind: str

    def create(self, spec: SandboxSpec, slot: int) -> Handle:
        """Start a sandbox in network slot `slot`; return once its root process runs (not yet its agent)."""

    def is_alive(self, handle: Handle) -> bool: ...

    def checkpoint(self, handle: Handle, image_dir: Path, leave_running: bool = True) -> None:
        """Write a consistent image of memory, processes and files into image_dir. A frozen sandbox stays frozen."""

    def freeze(self, handle: Handle) -> None:
        """Stop every task of the sandbox where it is, holding its memory (a standby for a quick thaw)."""

    def thaw(self, handle: Handle) -> None:
        """Let a frozen sandbox run on from exactly where it was frozen."""

    def restore(self, spec: SandboxSpec, image_dir: Path, slot: int) -> Handle:
        """Start a new sandbox, in network slot `slot`, from an image written by checkpoint()."""

    def destroy(self, handle: Handle) -> None:
        """Stop the sandbox and release everything it held; idempotent."""

    def cgroup_stats(self, handle: Handle) -> dict[str, int]:
        """Real figures from the host's cgroups: cpu_ns, mem_used, mem_cache, mem_limit."""

    def statuses(self) -> dict[str, str]:
        """Every sandbox of this runtime on the host, by name: "running", "paused" (frozen), ... (for re-adoption)."""
