"""What of a gVisor instance is still on the host, found by reading the host's own tables (no runsc, no
subprocess): its files in the runsc root, loop devices backed by its disk, its /dev/shm folders
(docs/design/teardown.md)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

SHM = Path("/dev/shm")
BLOCK = Path("/sys/block")


def container_files(root: Path, name: str) -> list[Path]:
    """runsc's files of the container `name` in its root: state and lock (`<sandbox>_sandbox:<container>.state`,
    `.lock`) and the sandbox's control socket (`runsc-<name>.sock`). A create that timed out may leave the lock
    alone."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    return sorted(p for p in entries if p.name.startswith(f"{name}_sandbox:") or p.name == f"runsc-{name}.sock")


def container_pids(root: Path, name: str) -> list[int]:
    """The sandbox and gofer processes runsc recorded for the container (0s left out)."""
    out: list[int] = []
    for p in container_files(root, name):
        if p.suffix != ".state":
            continue
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        sandbox = doc.get("sandbox") or {}
        out += [int(pid) for pid in (doc.get("goferPid"), sandbox.get("pid")) if isinstance(pid, int) and pid > 0]
    return out


def containers(root: Path) -> dict[str, Path | None]:
    """Every container in the runsc root, by name, with its bundle folder (None if its state is unreadable)."""
    out: dict[str, Path | None] = {}
    try:
        entries = list(root.iterdir())
    except OSError:
        return out
    for p in entries:
        if not p.name.endswith(".state") or ":" not in p.name:
            continue
        name = p.name[:-len(".state")].rsplit(":", 1)[1]
        try:
            bundle = json.loads(p.read_text()).get("bundleDir")
        except (OSError, ValueError):
            bundle = None
        out[name] = Path(bundle) if bundle else None
    return out


def loops_backed_by(folder: Path) -> list[str]:
    """Loop devices (/dev/loopN) whose backing file is in `folder` (a deleted one's name ends in " (deleted)")."""
    prefix = str(folder).rstrip("/") + "/"
    out: list[str] = []
    try:
        devices = list(BLOCK.glob("loop*"))
    except OSError:
        return out
    for dev in devices:
        try:
            backing = (dev / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue
        if backing.startswith(prefix):
            out.append(f"/dev/{dev.name}")
    return sorted(out)


def detach_loops(folder: Path) -> None:
    for dev in loops_backed_by(folder):
        subprocess.run(["losetup", "-d", dev], capture_output=True, text=True)


def shm_of(name: str) -> list[Path]:
    """/dev/shm entries named after the instance."""
    try:
        return sorted(p for p in SHM.iterdir() if name in p.name)
    except OSError:
        return []
