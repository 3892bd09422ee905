"""A sandbox's host cgroups (`/keepstate/<name>`, made by runsc from the OCI spec's cgroupsPath).

Freezing (docs/design/idle.md): the kernel's freezer stops every host process of the sandbox (sentry, gofer,
systrap stubs) where it is, so an idle sandbox costs no CPU at all; gVisor's own pause (`runsc pause`) stops the
sandbox's tasks but not the sentry's goroutines (the systrap fast-path loop keeps a core ~5 % busy). cgroup v1's
freezer (`freezer.state`: FROZEN / THAWED) where it is mounted, else cgroup v2's `cgroup.freeze`.

Writes are single small file writes (well under a millisecond), so callers on an event loop may make them inline.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

CGROUP_PARENT = "keepstate"
ROOT = Path("/sys/fs/cgroup")

__all__ = ["CGROUP_PARENT", "freeze", "frozen", "thaw"]


def _v1(name: str, root: Path = ROOT) -> Path | None:
    """The sandbox's v1 freezer cgroup, or None where no v1 freezer hierarchy is mounted."""
    if not (root / "freezer" / "freezer.state").exists() and not (root / "freezer" / "cgroup.procs").exists():
        return None
    return root / "freezer" / CGROUP_PARENT / name


def _v2(name: str, root: Path = ROOT) -> list[Path]:
    """The sandbox's v2 cgroups that can freeze: the unified root itself (a pure v2 host) or its hybrid mount."""
    return [base / CGROUP_PARENT / name for base in (root, root / "unified")
            if (base / CGROUP_PARENT / name / "cgroup.freeze").exists()]


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except FileNotFoundError:
        return False  # the sandbox (and so its cgroup) is gone


def freeze(name: str, root: Path = ROOT) -> bool:
    """Freeze every process of the sandbox; False if it has no cgroup to freeze (it is gone)."""
    v1 = _v1(name, root)
    done = _write(v1 / "freezer.state", "FROZEN") if v1 is not None else False
    for cg in _v2(name, root):
        done = _write(cg / "cgroup.freeze", "1") or done
    return done


def thaw(name: str, root: Path = ROOT) -> None:
    """Let the sandbox's processes run on; idempotent, and a no-op for a sandbox that is gone."""
    v1 = _v1(name, root)
    if v1 is not None:
        _write(v1 / "freezer.state", "THAWED")
    for cg in _v2(name, root):
        _write(cg / "cgroup.freeze", "0")


def frozen(name: str, root: Path = ROOT) -> bool:
    """Whether any of the sandbox's cgroups is frozen or freezing."""
    v1 = _v1(name, root)
    if v1 is not None:
        with contextlib.suppress(OSError):
            if (v1 / "freezer.state").read_text().strip() in ("FROZEN", "FREEZING"):
                return True
    for cg in _v2(name, root):
        with contextlib.suppress(OSError):
            if (cg / "cgroup.freeze").read_text().strip() == "1":
                return True
    return False
