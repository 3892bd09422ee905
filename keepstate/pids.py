"""Whether a process is alive, by pid: the one check every lock, claim and state file of ours uses."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """True if a process with this pid exists on this host (one we may not signal counts: it exists). Callers
    rule out pids of 0 and below where they can occur: `kill(0, 0)` asks about our own process group."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
