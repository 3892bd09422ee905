"""Containers' states read from runsc's own state files, without running runsc.

`runsc state` and `runsc list` ask each sandbox's sentry, and hang on a sandbox whose cgroup is frozen (an idle
sandbox, docs/design/idle.md); every server on the host shares one runsc root, so one frozen sandbox would hang
every server's `list`. runsc keeps a container's state in `<root>/<sandbox>_sandbox:<container>.state` (JSON:
`status` "created" | "running" | "paused" | "stopped", `sandbox.pid`), written under an exclusive flock of the
`.lock` file beside it; we read it as runsc's own readers do, under a shared flock, and, as runsc does, report a
container whose sandbox process has died as "stopped". A state that cannot be read is "unknown" (callers treat
it as alive: a sandbox is never reaped on a read that failed).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from keepstate import pids

SUFFIX = ".state"
LOCK_WAIT = 5.0  # seconds to wait for a runsc command holding the lock (a checkpoint can hold it that long)
TORN_RETRIES = 3

__all__ = ["container_state", "container_states"]


def _files(root: Path, name: str) -> tuple[Path, Path]:
    base = root / f"{name}_sandbox:{name}"
    return base.with_name(base.name + SUFFIX), base.with_name(base.name + ".lock")


@contextlib.contextmanager
def _shared(lock: Path) -> Iterator[None]:
    """A shared flock of the container's lock file, waited for at most LOCK_WAIT; without it if it stays held (the
    read is then checked for tearing instead)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the flock


def _alive(pid: Any) -> bool:
    return isinstance(pid, int) and pid > 0 and pids.alive(pid)


def _status(doc: Any) -> str:
    if not isinstance(doc, dict) or not isinstance(doc.get("status"), str):
        return "unknown"
    status: str = doc["status"]
    sandbox = doc.get("sandbox")
    if status in ("created", "running", "paused") and isinstance(sandbox, dict) and not _alive(sandbox.get("pid")):
        return "stopped"
    return status


def container_state(root: Path, name: str) -> str:
    """One container's state: its file's status, "gone" with no file, "unknown" if it cannot be read."""
    state, lock = _files(root, name)
    for _ in range(TORN_RETRIES):
        with _shared(lock):
            try:
                text = state.read_text()
            except FileNotFoundError:
                return "gone"
            except OSError:
                return "unknown"
        try:
            return _status(json.loads(text))
        except ValueError:
            time.sleep(0.01)  # torn: a writer was replacing it
    return "unknown"


def container_states(root: Path) -> dict[str, str]:
    """Every container under the root, by name (a sandbox's single container has the sandbox's name)."""
    out: dict[str, str] = {}
    try:
        entries = list(root.iterdir())
    except OSError:
        return out
    for entry in entries:
        stem, _, rest = entry.name.partition("_sandbox:")
        if not rest.endswith(SUFFIX) or rest[: -len(SUFFIX)] != stem:
            continue
        state = container_state(root, stem)
        if state != "gone":
            out[stem] = state
    return out
