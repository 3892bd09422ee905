"""Volumes at the paths their sandbox asked for: the runtime mounts volume i at a fixed point
(/opt/keepstate/volumes/i, which every template build has) and names the wanted path in VOLUME_MOUNTS_ENV
(keepstate/mountpoints.py); the agent, first thing at start, bind-mounts each there. The mount point is made
inside the sandbox, in its own writable layer, never in the template's directory on the host
(keepstate/runtime/gvisor.py says why).

A restored sandbox keeps its mounts (they are kernel state in the checkpoint); a cold boot (a filesystem-only
resume) makes them again.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os

from keepstate.mountpoints import VOLUME_MOUNTS_ENV

log = logging.getLogger("keepstate.agent")
MS_BIND = 4096


def mount_points(mountinfo: str = "/proc/self/mountinfo") -> set[str]:
    """Every mount point but the root (proc, dev, sys, our code, the template view, volumes)."""
    out = set()
    with contextlib.suppress(OSError), open(mountinfo) as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4:
                point = fields[4].encode().decode("unicode_escape")  # mountinfo escapes " " as \040
                if point != "/":
                    out.add(point)
    return out


def mount_volumes(spec: str | None = None) -> list[str]:
    """Bind-mount every (source, path) of VOLUME_MOUNTS_ENV not mounted yet; return the paths mounted."""
    pairs = json.loads(spec if spec is not None else os.environ.get(VOLUME_MOUNTS_ENV, "[]") or "[]")
    done = []
    libc = ctypes.CDLL(None, use_errno=True) if pairs else None
    mounted = mount_points() if pairs else set()
    for source, path in pairs:
        if path in mounted:
            continue
        os.makedirs(path, exist_ok=True)
        assert libc is not None
        if libc.mount(source.encode(), path.encode(), None, MS_BIND, None) != 0:
            err = ctypes.get_errno()
            log.error("cannot mount the volume at %s: %s", path, os.strerror(err))
            raise OSError(err, f"mount --bind {source} {path}: {os.strerror(err)}")
        done.append(path)
    return done
