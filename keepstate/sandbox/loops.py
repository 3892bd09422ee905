"""The manager's background loops: expiry (timeouts, standby release) and metrics (with death detection).

A sandbox frozen while idle (idle.py) is sampled from the host's cgroups alone: its agent is not asked (that would
wake it, or fail), and its last disk figures stand.

Neither acts on a sandbox itself: each asks the manager for a command (expire, died), which takes the sandbox's
lock and re-checks its state, so a loop never acts on a record a command has changed meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp

from keepstate.db.errors import DatabaseUnavailable
from keepstate.errors import KeepStateError

from .agent_client import Quiesced
from .instances import handle_of
from .record import SandboxRow
from .state import State

if TYPE_CHECKING:
    from .manager import SandboxManager

log = logging.getLogger("keepstate.sandbox")
EXPIRE_INTERVAL = 0.25
METRIC_INTERVAL = 5.0
UNAVAILABLE_LOG_S = 30.0


class MetricSamples:
    """Each running sandbox's metrics samples, the newest 720 (an hour at METRIC_INTERVAL), by sandbox ID."""

    def __init__(self) -> None:
        self._by_id: dict[str, deque[dict[str, Any]]] = {}

    def add(self, sandbox_id: str, sample: dict[str, Any]) -> None:
        self._by_id.setdefault(sandbox_id, deque(maxlen=720)).append(sample)

    def forget(self, sandbox_id: str) -> None:
        self._by_id.pop(sandbox_id, None)

    def get(self, sandbox_id: str) -> deque[dict[str, Any]] | None:
        return self._by_id.get(sandbox_id)

    def between(self, sandbox_id: str, start: float | None, end: float | None) -> list[dict[str, Any]]:
        return [s for s in self._by_id.get(sandbox_id, ())
                if (start is None or s["timestampUnix"] >= start) and (end is None or s["timestampUnix"] <= end)]

    def latest(self, sandbox_ids: list[str], listed: Callable[[str], bool]) -> dict[str, dict[str, Any]]:
        """The newest sample of each of these sandboxes that is `listed` and has one; the others are left out."""
        return {sid: samples[-1] for sid in sandbox_ids if (samples := self._by_id.get(sid)) and listed(sid)}


async def expire_loop(m: SandboxManager) -> None:
    quiet_until = 0.0  # a database that is away is said once per UNAVAILABLE_LOG_S, not at every tick
    while True:
        now = time.time()
        for row in m.running():
            if row.state == State.RUNNING and row.end_at <= now and not m.command_running(row.sandbox_id):
                try:
                    await m.expire(row.sandbox_id)
                except DatabaseUnavailable as exc:  # its timeout stays due: the next tick tries again
                    if time.monotonic() >= quiet_until:
                        log.warning("expiry of %s waits for the database: %s", row.sandbox_id, exc)
                        quiet_until = time.monotonic() + UNAVAILABLE_LOG_S
                except KeepStateError:
                    pass  # changed meanwhile (killed, paused): nothing to expire
                except Exception as exc:
                    log.warning("expiry of %s failed: %s", row.sandbox_id, exc)
        m.creates.trim()  # built templates' pools no create came for in a while
        if len(m.standbys):
            try:
                await m.trim_standbys()
            except Exception as exc:
                log.warning("releasing standbys failed: %s", exc)
        await asyncio.sleep(EXPIRE_INTERVAL)


async def metrics_loop(m: SandboxManager) -> None:
    last: dict[str, tuple[float, int]] = {}
    disks: dict[str, tuple[int, int]] = {}
    while True:
        for gone in set(last) - {r.sandbox_id for r in m.running()}:
            last.pop(gone, None)
            disks.pop(gone, None)
        try:
            net = await asyncio.to_thread(m.egress.counters)  # every sandbox's bytes, in one call
        except Exception as exc:
            log.debug("egress counters: %s", exc)
            net = {}
        for row in m.running():
            if row.state != State.RUNNING or m.agents.quiesced(row.sandbox_id):
                continue  # being checkpointed
            try:
                sample = await sample_once(m, row, last, disks)
            except Exception as exc:  # a sandbox dying mid-sample is normal
                log.debug("metrics of %s: %s", row.sandbox_id, exc)
                continue
            if sample is None:
                if not m.command_running(row.sandbox_id):  # a command holds it: it will know
                    await m.died(row.sandbox_id, row.runtime_name)
            elif sample:
                sample["networkTxBytes"], sample["networkRxBytes"] = net.get(row.sandbox_id, (0, 0))
                m.metrics.add(row.sandbox_id, sample)
        await asyncio.sleep(METRIC_INTERVAL)


async def sample_once(m: SandboxManager, row: SandboxRow, last: dict[str, tuple[float, int]],
                      disks: dict[str, tuple[int, int]] | None = None) -> dict[str, Any] | None:
    """One metrics sample: cgroup figures from the host, disk figures from the agent (the last ones it gave while the
    sandbox is frozen idle). None: the instance has no cgroup figures or does not answer (it may have died)."""
    disks = {} if disks is None else disks
    stats = await asyncio.to_thread(m.runtime.cgroup_stats, handle_of(row))
    if not stats:
        return None
    now = time.time()
    cpu_ns = stats.get("cpu_ns", 0)
    prev = last.get(row.sandbox_id)
    last[row.sandbox_id] = (now, cpu_ns)
    pct = 0.0
    if prev and now > prev[0]:
        pct = max(0.0, (cpu_ns - prev[1]) / 1e9 / (now - prev[0]) / max(row.cpu, 1) * 100)
    disk_used, disk_total = disks.get(row.sandbox_id, (0, 0))
    try:
        if not m.idle.frozen(row.sandbox_id):
            figures = await m.agents.metrics(row.sandbox_id, row.address, row.access_token)
            if figures:
                disk_used, disk_total = int(figures.get("disk_used", 0)), int(figures.get("disk_total", 0))
                disks[row.sandbox_id] = (disk_used, disk_total)
    except Quiesced:
        if not m.idle.frozen(row.sandbox_id):
            return {}  # checkpointed meanwhile: no sample this round, and not dead
    except (TimeoutError, aiohttp.ClientConnectorError):
        return None  # the agent does not answer: the caller asks the runtime whether it is gone
    except (aiohttp.ClientError, ValueError):
        pass
    mem_total = min(stats.get("mem_limit", 0), row.memory_mb << 20) or row.memory_mb << 20
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z",
        "timestampUnix": int(now), "cpuCount": int(row.cpu), "cpuUsedPct": round(pct, 2),
        "memUsed": stats.get("mem_used", 0), "memTotal": mem_total, "memCache": stats.get("mem_cache", 0),
        "diskUsed": disk_used, "diskTotal": disk_total,
    }


async def pause_all(m: SandboxManager, why: str, at_once: int = 4) -> None:
    """Pause every running sandbox to the store, `at_once` at a time, then release every standby: a node that leaves
    this way holds nothing another node cannot resume (docs/design/cluster.md). A pause that fails is logged; that
    sandbox stays as it was."""
    limit = asyncio.Semaphore(at_once)

    async def one(sandbox_id: str) -> None:
        async with limit:
            try:
                await m.pause(sandbox_id)
            except Exception as exc:  # noqa: BLE001 - every other sandbox is still paused
                log.error("pausing %s as %s failed: %r", sandbox_id, why, exc)

    running = [r.sandbox_id for r in m.running()]
    log.info("pausing %d running sandboxes: %s", len(running), why)
    await asyncio.gather(*(one(s) for s in running))
    await asyncio.gather(*(m.release_standby(s, why) for s in m.standbys.ids()), return_exceptions=True)
