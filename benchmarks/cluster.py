"""A cluster's overheads on one machine: nodes (in-process servers on the fake runtime, so that what is measured is
KeepState's own path, not gVisor's) on a throwaway PostgreSQL 15 and one shared store (docs/design/cluster.md).

    python benchmarks/cluster.py [--runs 500] [--only hop,move,renewal,heartbeat,death,creates]

  * hop: the relaying hop: a control-plane call (`GET /sandboxes/{id}`) and a data-plane request (the agent's
    `GET /health` by `E2b-Sandbox-Id`) through the node that does not hold the sandbox, beside the same request to
    the node that does, p50 and p99 of --runs on kept connections. Goal: the hop adds < 1 ms p50.
  * move: a paused session's move: the first connect through another node after its node left (the take-over and
    the resume from the store), beside a connect of a paused sandbox on the node that holds it (a resume alone).
  * renewal: a node's lease renewal: one renewal's round trip to PostgreSQL, p50.
  * heartbeat: --heartbeat-nodes simulated nodes (the server's own Membership, 200 by default) renewing their leases
    at the real cadence on the same PostgreSQL for --heartbeat-seconds, with one reaper, and again with every node
    reaping (as Membership.run does): renewals/s against the expected nodes / 2 s, renewal latency, and PostgreSQL's
    CPU time (its processes, /proc) beside the same PostgreSQL idle for the same window. No node may be declared
    dead or fence itself.
  * death: a node killed (kill -9 as the others see it: its renewals and its sockets cut, no leave, no pause at
    stop) with a paused sandbox; a client polls `connect` through another node every 0.25 s until it answers: the
    time from the death to the answer, in parts (the lease's rest, the reaper's grace and round, the take-over and
    resume), --deaths times, beside the same connect while its node is alive (relayed, resumed there). Default
    lease (TTL 10 s, renewal 2 s, margin 2 s). Goal: < 15 s.
  * creates: --creates creates, --create-concurrency at a time, through 1 node and through 3 (round robin, as a
    plain load balancer), each followed by its first data-plane request (an authenticated file write, POST /files:
    the fake's agent runs no process) through a different node than the one it was created through: creates/s and
    create-to-first-request p50/p95, 3 nodes beside 1.
Everything stays on loopback and a Unix socket.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_heartbeat import Beats, heartbeats  # noqa: E402

from keepstate.api.app import ServerConfig, create_app  # noqa: E402
from keepstate.api.keys import DATABASE  # noqa: E402
from keepstate.api.nodes import MEMBERSHIP  # noqa: E402
from keepstate.apikeys import issue  # noqa: E402
from keepstate.cluster.membership import FENCE_MARGIN_S, RENEW_S, TTL_S  # noqa: E402
from keepstate.db.records import NodeRecord  # noqa: E402
from keepstate.db.repos import Keys, Nodes  # noqa: E402
from keepstate.sandbox.admission import AdmissionConfig  # noqa: E402
from keepstate.testing import FakeRuntime, FakeTemplates  # noqa: E402
from keepstate.testing.postgres import PostgresServer  # noqa: E402

SUBS = ("hop", "move", "renewal", "heartbeat", "death", "creates")
POLL_S = 0.25  # the client's poll of a connect after a node's death


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Node:
    name: str
    url: str
    app: web.Application
    runner: web.AppRunner


@contextlib.asynccontextmanager
async def node(name: str, db_url: str, store: str, **options: Any) -> AsyncIterator[Node]:
    """A node of the cluster in this process; `options`: ServerConfig fields (the lease is the default one)."""
    port = free_port()
    runtime = FakeRuntime()
    fields: dict[str, Any] = {"pool_size": 1, "boot_images": False, "reap_on_exit": True, "freeze_idle_after": 0,
                              **options}
    config = ServerConfig(home=Path(tempfile.mkdtemp(prefix=f"ks-cluster-{name}-")), port=port, runtime="fake",
                          node=name, db_url=db_url, store_url=store, **fields)
    app = create_app(config, runtime, FakeTemplates())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield Node(name, f"http://127.0.0.1:{port}", app, runner)
    finally:
        await runner.cleanup()
        runtime.close()


async def kill(n: Node) -> float:
    """What a `kill -9` of the node's process leaves the others to see: its lease renewals stop (its membership loop
    is cancelled: no leave, no fence, no reaping) and its sockets close (the listener, and every connection cut, so
    that kept connections to it fail too). No pause at stop either: its cleanup, at the end, finds it fenced. The
    monotonic time of the death."""
    membership = n.app[MEMBERSHIP]
    loop = [t for t in asyncio.all_tasks() if t.get_name() == "membership"
            and getattr(getattr(t.get_coro(), "cr_frame", None), "f_locals", {}).get("self") is membership]
    assert len(loop) == 1, f"the membership loop of {n.name} not found"
    loop[0].cancel()
    died = time.monotonic()
    membership.fenced = "killed by the benchmark"
    for site in list(n.runner.sites):
        await site.stop()
    server = n.runner.server
    assert server is not None
    for handler in server.connections:
        if handler.transport is not None:
            handler.transport.abort()
    with contextlib.suppress(asyncio.CancelledError):
        await loop[0]
    return died


def pct(xs: list[float], p: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1000


async def timed(http: aiohttp.ClientSession, n: int, method: str, url: str, **kw: Any) -> list[float]:
    out = []
    for i in range(n + 20):
        start = time.perf_counter()
        async with http.request(method, url, **kw) as r:
            await r.read()
            assert r.status < 300, (url, r.status)
        if i >= 20:  # warmed up
            out.append(time.perf_counter() - start)
    return out


def row(what: str, ours: float, peer_name: str, peer: float, unit: str = "ms") -> None:
    ratio = f"{ours / peer:6.2f}x" if peer else "   n/a"
    print(f"  {what:<52} {ours:8.3f} {unit:<3} {peer_name:<26} {peer:8.3f} {unit:<3} ratio {ratio}")


async def create(http: aiohttp.ClientSession, url: str) -> tuple[str, str]:
    async with http.post(f"{url}/sandboxes", json={"templateID": "base", "timeout": 3600}) as r:
        made = await r.json()
        assert r.status == 201, made
    return made["sandboxID"], made["envdAccessToken"]


async def write_file(http: aiohttp.ClientSession, url: str, sid: str, token: str, path: str, data: bytes) -> None:
    """The SDK's files.write: a multipart upload to the sandbox's agent, by E2b-Sandbox-Id (the data plane)."""
    form = aiohttp.FormData()
    form.add_field("file", data, filename=path.rsplit("/", 1)[-1])
    async with http.post(f"{url}/files", params={"path": path, "username": "user"}, data=form,
                         headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token}) as r:
        assert r.status == 200, await r.text()


async def pair(url: str, store: str, args: argparse.Namespace, only: set[str]) -> None:
    """hop, move and renewal: two nodes, a and b."""
    async with node("a", url, store) as a, node("b", url, store) as b:
        key = (await issue(Keys(a.app[DATABASE]), "bench"))[1]
        async with aiohttp.ClientSession(headers={"X-API-KEY": key}) as http:
            sid, token = await create(http, a.url)
            data = {"E2b-Sandbox-Id": sid, "X-Access-Token": token}
            if "hop" in only:
                print(f"relaying hop, p50 / p99 of {args.runs} on kept connections (fake runtime; ratio: relayed / "
                      "direct)")
                direct = await timed(http, args.runs, "GET", f"{a.url}/sandboxes/{sid}")
                relayed = await timed(http, args.runs, "GET", f"{b.url}/sandboxes/{sid}")
                row("control plane GET /sandboxes/{id}, p50", pct(relayed, .5), "owner directly", pct(direct, .5))
                row("control plane GET /sandboxes/{id}, p99", pct(relayed, .99), "owner directly", pct(direct, .99))
                print(f"  -> the hop adds {pct(relayed, .5) - pct(direct, .5):.3f} ms p50 (goal < 1 ms)")
                direct = await timed(http, args.runs, "GET", f"{a.url}/health", headers=data)
                relayed = await timed(http, args.runs, "GET", f"{b.url}/health", headers=data)
                row("data plane GET /health by E2b-Sandbox-Id, p50", pct(relayed, .5), "owner directly",
                    pct(direct, .5))
                print(f"  -> the hop adds {pct(relayed, .5) - pct(direct, .5):.3f} ms p50 (goal < 1 ms)\n")
            nodes = Nodes(a.app[DATABASE])
            if "move" in only:  # a resume on the node that holds it, then a move after that node left
                async with http.post(f"{a.url}/sandboxes/{sid}/pause") as r:
                    assert r.status == 204
                start = time.perf_counter()
                async with http.post(f"{a.url}/sandboxes/{sid}/connect", json={"timeout": 600}) as r:
                    assert r.status == 201
                local = time.perf_counter() - start
                async with http.post(f"{a.url}/sandboxes/{sid}/pause") as r:
                    assert r.status == 204
                me = await nodes.get("a")
                assert me is not None and await nodes.leave("a", me.incarnation)  # as a's SIGTERM ends
                start = time.perf_counter()
                async with http.post(f"{b.url}/sandboxes/{sid}/connect", json={"timeout": 600}) as r:
                    assert r.status == 201, await r.text()
                moved = time.perf_counter() - start
                print("a paused session's first connect (fake runtime: the resume is a restore of the fake)")
                row("through another node, its node gone (take-over)", moved * 1000, "on its own node",
                    local * 1000)
                print()
            if "renewal" in only:
                renewals = []
                for _ in range(200):
                    start = time.perf_counter()
                    await nodes.renew("b", (await nodes.get("b")).incarnation, TTL_S)  # type: ignore[union-attr]
                    renewals.append(time.perf_counter() - start)
                print(f"lease renewal round trip p50 {pct(renewals, .5):.3f} ms (with the read of the node's "
                      "row): 200 nodes renewing every 2 s are 100 such writes a second\n")


def show_heartbeats(out: list[Beats], engines: int) -> None:
    first = out[0]
    idle = first.idle
    assert idle is not None
    print(f"heartbeat load: {first.nodes} simulated nodes on PostgreSQL (Membership.renew_once every {RENEW_S:.0f} s, "
          f"phases spread over it, lease {TTL_S:.0f} s; {engines} shared engine(s), pool 5+10 each), "
          f"{first.seconds:.0f} s each; peer: the same PostgreSQL idle for {idle.seconds:.1f} s")
    for b in out:
        pg = b.pg
        assert pg is not None
        expected = b.nodes / RENEW_S
        print(f" {b.reapers} reaper(s) (expire every {RENEW_S:.0f} s, grace {FENCE_MARGIN_S:.0f} s; "
              f"{'as Membership.run does: every node' if b.reapers == b.nodes else 'one node'}):")
        row("renewals per second achieved", len(b.renewals) / b.seconds, "expected", expected, "/s")
        print(f"  renewal latency p50 / p95 / p99 {pct(b.renewals, .5):.3f} / {pct(b.renewals, .95):.3f} / "
              f"{pct(b.renewals, .99):.3f} ms (this process's event loop wakes late by p50 / p95 / p99 "
              f"{pct(b.loop_lag, .5):.3f} / {pct(b.loop_lag, .95):.3f} / {pct(b.loop_lag, .99):.3f} ms)")
        if b.reaps:
            print(f"  reaping round (expire) p50 {pct(b.reaps, .5):.3f} ms, {len(b.reaps) / b.seconds:.1f} a second")
        row("PostgreSQL CPU, % of one core", pg.cpu_pct, "idle, same window", idle.cpu_pct, "%")
        row("PostgreSQL commits per second (a pre-ping is one)", pg.commits / pg.seconds, "idle, same window",
            idle.commits / idle.seconds, "/s")
        row("rows updated per second (pg_stat_database)", pg.updated / pg.seconds, "idle, same window",
            idle.updated / idle.seconds, "/s")
        row("WAL written, KiB per second", pg.wal_bytes / 1024 / pg.seconds, "idle, same window",
            idle.wal_bytes / 1024 / idle.seconds, "KiB")
        print(f"  this process (the {b.nodes} nodes' Python side): {100 * b.client_cpu_s / pg.seconds:.1f} % of a core")
        wrong = len(b.declared_dead) + len(b.fenced) + b.failed
        print(f"  failed renewals {b.failed}, nodes declared dead {len(b.declared_dead)} {b.declared_dead[:5]}, "
              f"fenced or no longer alive {len(b.fenced)} {b.fenced[:5]}; longest gap between a node's good "
              f"renewals {b.max_gap:.2f} s (it fences at {TTL_S - FENCE_MARGIN_S:.0f} s)"
              + ("" if not wrong else "  <-- WRONG: every node was alive"))
    print()


async def death(url: str, store: str, runs: int) -> None:
    """A node with a paused sandbox dies; a client polls connect through the other node until it answers."""
    async with node("b", url, store) as b:  # the default lease, and the reaper's grace: the fence margin
        up = time.monotonic()
        nodes = Nodes(b.app[DATABASE])
        key = (await issue(Keys(b.app[DATABASE]), "bench"))[1]
        declared: dict[str, float] = {}
        membership = b.app[MEMBERSHIP]
        reap = membership.reap_once

        async def watched() -> list[NodeRecord]:
            dead = await reap()
            for d in dead:
                declared.setdefault(d.node_id, time.monotonic())
            return dead

        membership.reap_once = watched  # type: ignore[method-assign]
        totals: list[float] = []
        peers: list[float] = []
        print(f"a node's death to its paused session answering through another node (default lease: TTL "
              f"{TTL_S:.0f} s, renewal {RENEW_S:.0f} s, margin {FENCE_MARGIN_S:.0f} s; the reaper's grace the "
              f"margin; connect polled every {POLL_S} s through the other node)")
        async with aiohttp.ClientSession(headers={"X-API-KEY": key},
                                         timeout=aiohttp.ClientTimeout(total=30)) as http:
            for run in range(1, runs + 1):
                name = f"a{run}"
                async with node(name, url, store, on_stop="keep", reap_on_exit=False) as a:
                    sid, token = await create(http, a.url)
                    await write_file(http, a.url, sid, token, "/home/user/before.txt", name.encode())
                    for peer in (True, False):
                        async with http.post(f"{a.url}/sandboxes/{sid}/pause") as r:
                            assert r.status == 204, await r.text()
                        if peer:  # the same connect while the owner lives: relayed to it, resumed there
                            start = time.perf_counter()
                            async with http.post(f"{b.url}/sandboxes/{sid}/connect", json={"timeout": 600}) as r:
                                assert r.status == 201, await r.text()
                            peers.append(time.perf_counter() - start)
                    # b's reaper starts once b has renewed for 2 TTL (a cluster's nodes have, long since)
                    await asyncio.sleep(max(0.0, up + 2 * TTL_S + 0.5 - time.monotonic()))
                    # Each run dies at its own point of a's renewal period: (run - 0.5) / runs of it after a renewal.
                    renewed = a.app[MEMBERSHIP].last_ok
                    while a.app[MEMBERSHIP].last_ok == renewed:
                        await asyncio.sleep(0.01)
                    phase = RENEW_S * (run - 0.5) / runs
                    await asyncio.sleep(max(0.0, a.app[MEMBERSHIP].last_ok + phase - time.monotonic()))
                    died = await kill(a)
                    gone = await nodes.get(name)
                    assert gone is not None
                    lease_left = gone.lease_expires_at - await nodes.now() + (time.monotonic() - died)
                    seen: Counter[int] = Counter()
                    while True:
                        sent = time.monotonic()
                        assert sent - died < 90, f"no answer 90 s after {name} died: {dict(seen)}"
                        async with http.post(f"{b.url}/sandboxes/{sid}/connect", json={"timeout": 600}) as r:
                            await r.read()
                            if r.status in (200, 201):
                                answered = time.monotonic()
                                break
                            seen[r.status] += 1
                        await asyncio.sleep(max(0.0, sent + POLL_S - time.monotonic()))
                    async with http.get(f"{b.url}/files", params={"path": "/home/user/before.txt"},
                                        headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token}) as r:
                        kept = r.status == 200 and await r.read() == name.encode()
                    dead_at = declared.get(name, float("nan"))
                    total = answered - died
                    totals.append(total)
                    print(f"  run {run} (killed {phase:.2f} s after a renewal): answered {total:6.2f} s after the "
                          f"death = lease's rest {lease_left:5.2f} s + grace and reaper round "
                          f"{dead_at - died - lease_left:5.2f} s + to the next poll {max(0.0, sent - dead_at):4.2f} s"
                          f" + take-over and resume {(answered - max(sent, dead_at)) * 1000:5.1f} ms; answers "
                          f"before: {dict(seen)}; its file {'kept' if kept else 'LOST'}")
        row("death to answering, median of runs", statistics.median(totals), "owner alive (relayed)",
            statistics.median(peers), "s")
        print(f"  -> {statistics.median(totals):.2f} s median (goal < 15 s: "
              f"{'met' if statistics.median(totals) < 15 else 'missed'}); the lease bounds it from below: up to "
              f"TTL {TTL_S:.0f} s + grace {FENCE_MARGIN_S:.0f} s + a reaper round {RENEW_S:.0f} s\n")


async def create_round(http: aiohttp.ClientSession, nodes: list[Node], total: int,
                       concurrency: int) -> tuple[float, list[float], list[float]]:
    """(creates per second, create latencies, create-to-first-request latencies), after a warm-up."""
    n = len(nodes)

    async def one(i: int, made: list[float], first: list[float]) -> None:
        start = time.perf_counter()
        sid, token = await create(http, nodes[i % n].url)  # round robin, as a plain load balancer
        made.append(time.perf_counter() - start)
        await write_file(http, nodes[(i + 1) % n].url, sid, token, "/home/user/first.txt", b"hello")
        first.append(time.perf_counter() - start)

    for i in range(2 * n):  # warm up: connections, caches
        await one(i, [], [])
    counter = itertools.count()
    made: list[float] = []
    first: list[float] = []

    async def worker() -> None:
        while (i := next(counter)) < total:
            await one(i, made, first)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total / (time.perf_counter() - start), made, first


async def creates(pg: PostgresServer, store: str, total: int, concurrency: int) -> None:
    print(f"creates and create-to-first-request, {total} creates {concurrency} at a time (fake runtime: this is "
          "the control plane and the hop, not gVisor; no warm pool, so every create starts a sandbox; the first "
          "request is a file write through a different node than the create's when there are 3)")
    got: dict[int, tuple[float, list[float], list[float]]] = {}
    for n in (1, 3):
        url = pg.createdb(f"bench_creates_{n}")
        async with contextlib.AsyncExitStack() as stack:
            nodes = [await stack.enter_async_context(
                node(f"c{i + 1}", url, store, pool_size=0, admission=AdmissionConfig(max_sandboxes_per_key=0)))
                for i in range(n)]
            key = (await issue(Keys(nodes[0].app[DATABASE]), "bench"))[1]
            async with aiohttp.ClientSession(headers={"X-API-KEY": key},
                                             connector=aiohttp.TCPConnector(limit=0)) as http:
                got[n] = await create_round(http, nodes, total, concurrency)
    (rate1, made1, first1), (rate3, made3, first3) = got[1], got[3]
    row("creates per second (ratio < 1: slower)", rate3, "1 node, same concurrency", rate1, "/s")
    row("create p50", pct(made3, .5), "1 node", pct(made1, .5))
    row("create-to-first-request p50", pct(first3, .5), "1 node", pct(first1, .5))
    row("create-to-first-request p95", pct(first3, .95), "1 node", pct(first1, .95))
    print("  (all the nodes share this process's one event loop and the host's 2 cores: 3 nodes add hops and "
          "lookups, not CPU)\n")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=500, help="requests per figure of the hop")
    ap.add_argument("--only", default=",".join(SUBS), help=f"comma-separated, of: {','.join(SUBS)}")
    ap.add_argument("--heartbeat-nodes", type=int, default=200)
    ap.add_argument("--heartbeat-seconds", type=float, default=20.0)
    ap.add_argument("--heartbeat-reapers", default="1,all",
                    help="comma-separated: how many of the nodes reap each round, one window each ('all': every one)")
    ap.add_argument("--heartbeat-engines", type=int, default=10,
                    help="SQLAlchemy engines the nodes share, round robin (a server has one of its own)")
    ap.add_argument("--deaths", type=int, default=3, help="node deaths to time")
    ap.add_argument("--creates", type=int, default=60, help="creates to time with 1 node and with 3")
    ap.add_argument("--create-concurrency", type=int, default=6)
    args = ap.parse_args()
    only = set(args.only.split(","))
    if only - set(SUBS):
        ap.error(f"--only: unknown {','.join(sorted(only - set(SUBS)))}")
    with PostgresServer() as pg:
        store = f"file://{tempfile.mkdtemp(prefix='ks-cluster-store-')}"
        if only & {"hop", "move", "renewal"}:
            await pair(pg.createdb("bench_cluster"), store, args, only)
        if "heartbeat" in only:
            reapers = [args.heartbeat_nodes if k == "all" else int(k) for k in args.heartbeat_reapers.split(",")]
            show_heartbeats(await heartbeats(pg, "bench_heartbeat", args.heartbeat_nodes, args.heartbeat_seconds,
                                             reapers, args.heartbeat_engines), args.heartbeat_engines)
        if "death" in only:
            await death(pg.createdb("bench_death"), store, args.deaths)
        if "creates" in only:
            await creates(pg, store, args.creates, args.create_concurrency)


if __name__ == "__main__":
    asyncio.run(main())
