"""A sandbox's host cgroups (`<parent>/<name>` of every cgroup v1 controller, and of the v2 hierarchy when it uses
one; made by runsc from the OCI spec's cgroupsPath), used without runsc.

Teardown (docs/design/teardown.md): killing its processes here is a write per process, where `runsc kill` is a Go
process start that competes with every other sandbox for the CPUs.

Freezing (docs/design/idle.md): the kernel's freezer stops every host process of the sandbox (sentry, gofer,
systrap stubs) where it is, so an idle sandbox costs no CPU at all; gVisor's own pause (`runsc pause`) stops the
sandbox's tasks but not the sentry's goroutines (the systrap fast-path loop keeps a core ~5 % busy). cgroup v1's
freezer (`freezer.state`: FROZEN / THAWED) where it is mounted, else cgroup v2's `cgroup.freeze`. Writes are single
small file writes (well under a millisecond), so callers on an event loop may make them inline.
"""


from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from pathlib import Path

CGROUP_PARENT = "keepstate"
ROOT = Path("/sys/fs/cgroup")
UNIFIED = "unified"  # where a hybrid host mounts cgroup2; on a pure v2 host ROOT itself is the v2 hierarchy


def paths(parent: str, name: str, root: Path = ROOT) -> list[Path]:
    """Every existing cgroup folder of the sandbox: one per v1 controller, and the v2 one."""
    out: list[Path] = []
    if (root / "cgroup.controllers").exists():  # pure v2
        candidates = [root / parent / name]
    else:
        try:
            mounts = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())
        except OSError:
            mounts = []
        candidates = [m / parent / name for m in mounts]
    for c in candidates:
        if c.is_dir():
            out.append(c)
    return out


def pids(folders: list[Path]) -> set[int]:
    """The processes (and threads, from v1's `tasks`) in these cgroups and their children."""
    found: set[int] = set()
    for folder in folders:
        for sub, _dirs, _files in os.walk(folder):
            for leaf in ("cgroup.procs", "tasks"):
                try:
                    text = (Path(sub) / leaf).read_text()
                except OSError:
                    continue
                found.update(int(p) for p in text.split())
    return found


def _folder_frozen(folder: Path) -> bool:
    for leaf, values in (("freezer.state", ("FROZEN", "FREEZING")), ("cgroup.freeze", ("1",))):
        try:
            if (folder / leaf).read_text().strip() in values:
                return True
        except OSError:
            continue
    return False


def _folder_thaw(folder: Path) -> None:
    for leaf, value in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
        if (folder / leaf).exists():
            try:
                (folder / leaf).write_text(value)
            except OSError:
                pass


def kill(folders: list[Path]) -> int:
    """SIGKILL every process of the cgroups, then thaw the frozen ones (a frozen process receives its SIGKILL only
    once thawed, and thawing after the kills lets nothing run in between). Returns how many were signalled."""
    targets = pids(folders)
    for pid in targets:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for folder in folders:
        for sub, _dirs, _files in os.walk(folder):
            if _folder_frozen(Path(sub)):
                _folder_thaw(Path(sub))
    return len(targets)


def _state(pid: int) -> str:
    """The process's state letter ("Z": a zombie, "": gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[0]


def kill_all(parent: str, name: str, timeout: float = 10.0, root: Path = ROOT) -> list[int]:
    """Kill every process of the sandbox's cgroups (any that appear meanwhile too) and wait until they are dead, at
    most `timeout` seconds; returns those still alive then (empty: all dead).

    Dead, not reaped: a zombie holds nothing but its pid, and its parent (init, for a detached sandbox) may take
    long to reap it (this host's: 1.2 s idle, over a minute at a load of 80)."""
    folders = paths(parent, name, root)
    if not folders:
        return []
    deadline = time.monotonic() + timeout
    seen: set[int] = set()
    pause = 0.005
    while True:
        kill(folders)
        seen |= pids(folders)
        alive = sorted(pid for pid in seen if _state(pid) not in ("", "Z"))
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def remove(parent: str, name: str, root: Path = ROOT) -> list[Path]:
    """rmdir the sandbox's (empty) cgroups, children first; returns those that could not be removed."""
    failed: list[Path] = []
    for folder in paths(parent, name, root):
        for sub, _dirs, _files in sorted(os.walk(folder), key=lambda w: -len(w[0])):
            try:
                os.rmdir(sub)
            except FileNotFoundError:
                pass
            except OSError:
                failed.append(Path(sub))
    return failed


# -- freezing (idle sandboxes) ------------------------------------------------------------------------------------
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
    except OSError as exc:  # the sandbox (and so its cgroup) is gone, or being removed (ENODEV)
        if exc.errno in (errno.ENOENT, errno.ENODEV):
            return False
        raise


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
