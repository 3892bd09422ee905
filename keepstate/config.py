"""Where KeepState keeps its data, and the settings every component shares."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """The data directory: $KEEPSTATE_HOME, default /var/lib/keepstate."""
    return Path(os.environ.get("KEEPSTATE_HOME", "/var/lib/keepstate"))


# A sandbox's disk (its writable layer) when its template names none: E2B's smallest plan.
DEFAULT_DISK_MB = 10240


# Admission (docs/design/admission.md): how many sandbox starts run at once, how many wait, and for how long.
START_WAIT_SECONDS = 30.0
MAX_SANDBOXES_PER_KEY = 100  # running sandboxes of one API key: E2B's Pro plan; 0 means unlimited
MEMORY_PER_SANDBOX = 64 << 20  # the least a sandbox holds (runsc and the agent): MemTotal / this bounds a host


def cpus() -> int:
    return len(os.sched_getaffinity(0)) or os.cpu_count() or 1


def default_max_starts(cpu_count: int | None = None) -> int:
    # One start per CPU: a restore is CPU-bound kernel work (docs/design/admission.md, "Defaults").
    return max(2, cpu_count or cpus())


def default_start_queue(max_starts: int) -> int:
    return 8 * max_starts


def mem_total() -> int:
    """The host's memory in bytes (/proc/meminfo)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemTotal")


def default_max_sandboxes(network_slots: int, memory: int | None = None, cpu_count: int | None = None) -> int:
    """Instances one host may hold: min(MemTotal / 64 MiB, 200 × CPUs, network slots)."""
    return min((memory or mem_total()) // MEMORY_PER_SANDBOX, 200 * (cpu_count or cpus()), network_slots)
