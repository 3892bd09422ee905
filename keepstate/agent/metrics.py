"""`GET /metrics`: CPU, memory and disk use of the sandbox, from /proc and statvfs."""

from __future__ import annotations

import os
import time
from typing import Any


def parse_cpu_times(stat_text: str) -> tuple[int, int]:
    """(busy, total) jiffies from the aggregate `cpu` line of /proc/stat."""
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            values = [int(v) for v in line.split()[1:]]
            idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
            total = sum(values[:8])
            return total - idle, total
    return 0, 0


def parse_meminfo(text: str) -> dict[str, int]:
    """Bytes per /proc/meminfo key."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


class MetricsSampler:
    """CPU use is a rate: each call reports the share since the previous call."""

    def __init__(self) -> None:
        self._last: tuple[int, int] | None = None

    def _read(self, path: str) -> str:
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return ""

    def sample(self) -> dict[str, Any]:
        busy, total = parse_cpu_times(self._read("/proc/stat"))
        cpu_pct = 0.0
        if self._last is not None and total > self._last[1]:
            cpu_pct = 100.0 * (busy - self._last[0]) / (total - self._last[1])
        elif total:
            cpu_pct = 100.0 * busy / total
        self._last = (busy, total)
        mem = parse_meminfo(self._read("/proc/meminfo"))
        mem_total = mem.get("MemTotal", 0)
        mem_cache = mem.get("Cached", 0) + mem.get("Buffers", 0)
        mem_used = max(mem_total - mem.get("MemAvailable", mem.get("MemFree", 0)), 0)
        try:
            vfs = os.statvfs("/")
            disk_total = vfs.f_blocks * vfs.f_frsize
            disk_used = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
        except OSError:
            disk_total = disk_used = 0
        return {
            "ts": int(time.time()),
            "cpu_count": os.cpu_count() or 1,
            "cpu_used_pct": round(cpu_pct, 2),
            "mem_total": mem_total,
            "mem_used": mem_used,
            "mem_cache": mem_cache,
            "mem_total_mib": mem_total >> 20,
            "mem_used_mib": mem_used >> 20,
            "disk_used": disk_used,
            "disk_total": disk_total,
        }
