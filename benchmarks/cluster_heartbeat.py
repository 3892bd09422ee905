"""For benchmarks/cluster.py: the heartbeat load of many simulated nodes on one PostgreSQL, and what that PostgreSQL
spends on it (its processes' CPU time from /proc, its commits, updated rows and WAL bytes).

Each simulated node is the server's own `Membership` (keepstate/cluster/membership.py) on `Nodes`, joined as a new
incarnation, renewing with `renew_once` at the real cadence (RENEW_S, each node's phase spread over one period) and
the real lease (TTL_S, FENCE_MARGIN_S), so its fence is judged as a server's is. The reaper is `reap_once`
(`expire` with the real grace, FENCE_MARGIN_S) run by the first `reapers` nodes after their renewals, each round, as
`Membership.run` does (without its 2 TTL wait: the window is shorter than that). All of it runs in this process on
`engines` shared SQLAlchemy engines (each its default pool: 5 connections kept, 10 more on demand; `pool_pre_ping`,
as a server's).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from keepstate.cluster.membership import RENEW_S, Membership
from keepstate.db.engine import Database
from keepstate.db.records import NodeRecord
from keepstate.db.repos import Nodes
from keepstate.db.setup import prepare
from keepstate.testing.postgres import PostgresServer

TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class PgUse:
    """What the PostgreSQL server spent over a window."""

    seconds: float  # the window's wall time
    cpu_s: float  # CPU time of the postmaster and all its children (exited ones through its cutime/cstime)
    commits: int  # pg_stat_database.xact_commit of the benchmark's database
    updated: int  # pg_stat_database.tup_updated
    wal_bytes: int  # the WAL written (cluster-wide)

    @property
    def cpu_pct(self) -> float:
        """As % of one core."""
        return 100 * self.cpu_s / self.seconds


class PgMeter:
    def __init__(self, pg: PostgresServer, dbname: str) -> None:
        self.pg, self.dbname = pg, dbname

    def cpu(self) -> float:
        """CPU seconds of the server's processes so far: each live one's (the postmaster and its children: backends,
        checkpointer, WAL writer...) from /proc/<pid>/schedstat, the time it ran in ns (utime + stime, without
        their 10 ms ticks), and its exited children's from the postmaster's cutime + cstime (in ticks)."""
        postmaster = int((self.pg.data / "postmaster.pid").read_text().split()[0])
        total = 0.0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
                pid, ppid = int(entry.name), int(fields[1])
                if pid == postmaster or ppid == postmaster:
                    total += int(Path(entry.path, "schedstat").read_text().split()[0]) / 1e9
                if pid == postmaster:
                    total += (int(fields[13]) + int(fields[14])) / TICK  # cutime cstime: its reaped children
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
        return total

    def counters(self) -> tuple[int, int, int]:
        """(xact_commit, tup_updated, WAL position in bytes) now, through a connection of its own."""
        with psycopg.connect(self.pg.url("postgres"), autocommit=True) as conn:
            commits, updated = conn.execute("SELECT xact_commit, tup_updated FROM pg_stat_database WHERE datname = %s",
                                            (self.dbname,)).fetchone() or (0, 0)
            wal = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')").fetchone()
        return int(commits), int(updated), int(wal[0]) if wal else 0

    async def window(self, load: Callable[[], Awaitable[object]] | None, seconds: float) -> PgUse:
        """Measure while `load()` runs (it should last `seconds`), or over `seconds` of nothing (the idle baseline).
        Backends publish their statistics at most once a second when idle: read them after a settle."""
        before = await asyncio.to_thread(self.counters)
        await asyncio.sleep(0.3)  # the counters' own backend has exited and been reaped
        cpu, start = self.cpu(), time.monotonic()
        await (asyncio.sleep(seconds) if load is None else load())
        cpu, wall = self.cpu() - cpu, time.monotonic() - start
        await asyncio.sleep(1.5)
        after = await asyncio.to_thread(self.counters)
        return PgUse(wall, cpu, *(b - a for a, b in zip(before, after, strict=True)))


@dataclass
class Beats:
    """The renewals and reaping rounds of one window."""

    seconds: float
    nodes: int
    reapers: int
    renewals: list[float] = field(default_factory=list)  # latency of each renewal that succeeded, s
    failed: int = 0  # renewals that did not succeed (timed out, database away, refused)
    reaps: list[float] = field(default_factory=list)  # latency of each reaping round, s
    declared_dead: list[str] = field(default_factory=list)  # nodes the reaper declared dead (wrongly: all live)
    max_gap: float = 0.0  # the longest time between two good renewals of one node, s (it fences at TTL - margin)
    loop_lag: list[float] = field(default_factory=list)  # this process's event loop: a 10 ms sleep's overshoot, s
    client_cpu_s: float = 0.0  # this process's CPU over the window (the simulated nodes, SQLAlchemy, psycopg)
    fenced: list[str] = field(default_factory=list)  # nodes that fenced themselves or lost their incarnation
    pg: PgUse | None = None
    idle: PgUse | None = None


async def _beat(m: Membership, delay: float, until: float, reaper: bool, out: Beats) -> None:
    await asyncio.sleep(delay)
    last = time.monotonic()
    while (started := time.monotonic()) < until:
        before = m.last_ok
        await m.renew_once()
        done = time.monotonic()
        if m.last_ok != before:
            out.renewals.append(done - started)
            out.max_gap = max(out.max_gap, started - last)
            last = started
        else:
            out.failed += 1
        if reaper:
            dead = await m.reap_once()
            out.reaps.append(time.monotonic() - done)
            out.declared_dead += [d.node_id for d in dead]
        await asyncio.sleep(max(0.0, min(until, started + m.renew_s) - time.monotonic()))
        m.check_fence()


async def _lag(until: float, out: Beats) -> None:
    """How late this process's event loop wakes (what the renewals' latencies carry of the client's own load)."""
    while (started := time.monotonic()) < until:
        await asyncio.sleep(0.01)
        out.loop_lag.append(time.monotonic() - started - 0.01)


async def heartbeats(pg: PostgresServer, dbname: str, nodes: int, seconds: float, reapers: list[int],
                     engines: int) -> list[Beats]:
    """One idle window, then one window of `nodes` renewing per entry of `reapers` (how many of them reap)."""
    url = pg.createdb(dbname)
    home = Path(os.environ.get("TMPDIR", "/tmp"))
    dbs = [await prepare(url, home)] + [await Database.open(url) for _ in range(engines - 1)]
    meter = PgMeter(pg, dbname)
    try:
        await asyncio.sleep(1.5)  # the migration's statistics are published before the idle window
        idle = await meter.window(None, seconds)
        members = [Membership(Nodes(dbs[i % engines]), _record(i), fencing=True,
                              metrics=lambda: {"sandboxes": 0, "teardowns": 0}) for i in range(nodes)]
        for m in members:
            await m.join()
        incarnations = [m.incarnation for m in members]
        out = []
        for k in reapers:
            beats = Beats(seconds, nodes, k, idle=idle)
            cpu = time.process_time()

            async def load(k: int = k, beats: Beats = beats) -> None:
                until = time.monotonic() + seconds
                await asyncio.gather(_lag(until, beats), *(_beat(m, i * RENEW_S / nodes, until, i < k, beats)
                                                           for i, m in enumerate(members)))

            beats.pg = await meter.window(load, seconds)
            beats.client_cpu_s = time.process_time() - cpu  # includes the 1.5 s settle (idle)
            stored = {n.node_id: n for n in await Nodes(dbs[0]).list()}
            beats.fenced = [m.me.node_id for m, inc in zip(members, incarnations, strict=True)
                            if m.fenced is not None or m.incarnation != inc
                            or stored[m.me.node_id].state != "alive"]
            out.append(beats)
        return out
    finally:
        for db in dbs:
            await db.close()


def _record(i: int) -> NodeRecord:
    return NodeRecord(node_id=f"sim-{i:03d}", address=f"http://10.0.{i // 250}.{i % 250 + 1}:3000", cpus=2,
                      memory_mb=4096, max_sandboxes=100, runsc_release="fake-1", templates=("base",))
