"""Volumes at the paths their sandbox asked for: the runtime mounts volume i at a fixed point
(/opt/keepstate/volumes/i, which every template build has) and names the wanted path in KEEPSTATE_VOLUME_MOUNTS;
the agent, first thing at start, bind-mounts each there. The mount point is made inside the sandbox, in its own
writable layer, never in the template's directory on the host (keepstate/runtime/gvisor.py says why).

A restored sandbox keeps its mounts (they are kernel state in the checkpoint); a cold boot (a filesystem-only
resume) makes them again.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os

log = logging.getLogger("keepstate.agent")
MS_BIND = 4096
ENV = "KEEPSTATE_VOLUME_MOUNTS"


def _mounted(path: str) -> bool:
    try:
        with open("/proc/self/mountinfo") as f:
            return any(line.split()[4] == path for line in f if len(line.split()) > 4)
    except OSError:
        return False


def mount_volumes(spec: str | None = None) -> list[str]:
    """Bind-mount every (source, path) of KEEPSTATE_VOLUME_MOUNTS not mounted yet; return the paths mounted."""
    pairs = json.loads(spec if spec is not None else os.environ.get(ENV, "[]") or "[]")
    done = []
    libc = ctypes.CDLL(None, use_errno=True) if pairs else None
    for source, path in pairs:
        if _mounted(path):
            continue
        os.makedirs(path, exist_ok=True)
        assert libc is not None
        if libc.mount(source.encode(), path.encode(), None, MS_BIND, None) != 0:
            err = ctypes.get_errno()
            log.error("cannot mount the volume at %s: %s", path, os.strerror(err))
            raise OSError(err, f"mount --bind {source} {path}: {os.strerror(err)}")
        done.append(path)
    return done
