"""A cluster's overheads on one machine: two nodes (in-process servers on the fake runtime, so that what is measured
is KeepState's own path, not gVisor's) on a throwaway PostgreSQL 15 and one shared store (docs/design/cluster.md).

    python benchmarks/cluster.py [--runs 500]

  * The relaying hop: a control-plane call (`GET /sandboxes/{id}`) and a data-plane request (the agent's
    `GET /health` by `E2b-Sandbox-Id`) through the node that does not hold the sandbox, beside the same request to
    the node that does, p50 and p99 of --runs on kept connections. Goal: the hop adds < 1 ms p50.
  * A paused session's move: the first connect through another node after its node left (the take-over and the
    resume from the store), beside a connect of a paused sandbox on the node that holds it (a resume alone).
  * A node's lease renewal: one renewal's round trip to PostgreSQL, p50 (what 200 nodes add: 100 of them a second).
Everything stays on loopback and a Unix socket.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keepstate.api.app import ServerConfig, create_app  # noqa: E402
from keepstate.api.keys import DATABASE  # noqa: E402
from keepstate.apikeys import issue  # noqa: E402
from keepstate.db.repos import Keys, Nodes  # noqa: E402
from keepstate.testing import FakeRuntime, FakeTemplates  # noqa: E402
from keepstate.testing.postgres import PostgresServer  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def node(name: str, db_url: str, store: str) -> AsyncIterator[tuple[str, web.Application]]:
    port = free_port()
    runtime = FakeRuntime()
    config = ServerConfig(home=Path(tempfile.mkdtemp(prefix=f"ks-cluster-{name}-")), port=port, runtime="fake",
                          node=name, db_url=db_url, store_url=store, pool_size=1, boot_images=False,
                          reap_on_exit=True, freeze_idle_after=0)
    app = create_app(config, runtime, FakeTemplates())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        await runner.cleanup()
        runtime.close()


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
    print(f"  {what:<52} {ours:8.3f} {unit}  {peer_name:<22} {peer:8.3f} {unit}  ratio {ours / peer:6.2f}x")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=500)
    args = ap.parse_args()
    with PostgresServer() as pg:
        url = pg.createdb("bench_cluster")
        store = f"file://{tempfile.mkdtemp(prefix='ks-cluster-store-')}"
        async with node("a", url, store) as (a_url, a_app), node("b", url, store) as (b_url, _):
            key = (await issue(Keys(a_app[DATABASE]), "bench"))[1]
            h = {"X-API-KEY": key}
            async with aiohttp.ClientSession(headers=h) as http:
                async with http.post(f"{a_url}/sandboxes", json={"templateID": "base", "timeout": 3600}) as r:
                    made = await r.json()
                sid, token = made["sandboxID"], made["envdAccessToken"]
                data = {"E2b-Sandbox-Id": sid, "X-Access-Token": token}
                print(f"relaying hop, p50 / p99 of {args.runs} on kept connections (fake runtime; ratio: relayed / "
                      "direct)")
                direct = await timed(http, args.runs, "GET", f"{a_url}/sandboxes/{sid}")
                relayed = await timed(http, args.runs, "GET", f"{b_url}/sandboxes/{sid}")
                row("control plane GET /sandboxes/{id}, p50", pct(relayed, .5), "owner directly", pct(direct, .5))
                row("control plane GET /sandboxes/{id}, p99", pct(relayed, .99), "owner directly", pct(direct, .99))
                print(f"  -> the hop adds {pct(relayed, .5) - pct(direct, .5):.3f} ms p50 (goal < 1 ms)")
                direct = await timed(http, args.runs, "GET", f"{a_url}/health", headers=data)
                relayed = await timed(http, args.runs, "GET", f"{b_url}/health", headers=data)
                row("data plane GET /health by E2b-Sandbox-Id, p50", pct(relayed, .5), "owner directly",
                    pct(direct, .5))
                print(f"  -> the hop adds {pct(relayed, .5) - pct(direct, .5):.3f} ms p50 (goal < 1 ms)")

                # A resume on the node that holds it, then a move after that node left.
                async with http.post(f"{a_url}/sandboxes/{sid}/pause") as r:
                    assert r.status == 204
                start = time.perf_counter()
                async with http.post(f"{a_url}/sandboxes/{sid}/connect", json={"timeout": 600}) as r:
                    assert r.status == 201
                local = time.perf_counter() - start
                async with http.post(f"{a_url}/sandboxes/{sid}/pause") as r:
                    assert r.status == 204
                nodes = Nodes(a_app[DATABASE])
                me = await nodes.get("a")
                assert me is not None and await nodes.leave("a", me.incarnation)  # as a's SIGTERM ends
                start = time.perf_counter()
                async with http.post(f"{b_url}/sandboxes/{sid}/connect", json={"timeout": 600}) as r:
                    assert r.status == 201, await r.text()
                moved = time.perf_counter() - start
                print("\na paused session's first connect (fake runtime: the resume is a restore of the fake)")
                row("through another node, its node gone (take-over)", moved * 1000, "on its own node",
                    local * 1000)
                renewals = []
                for _ in range(200):
                    start = time.perf_counter()
                    await nodes.renew("b", (await nodes.get("b")).incarnation, 10.0)  # type: ignore[union-attr]
                    renewals.append(time.perf_counter() - start)
                print(f"\nlease renewal round trip p50 {pct(renewals, .5):.3f} ms (with the read of the node's "
                      "row): 200 nodes renewing every 2 s are 100 such writes a second")


if __name__ == "__main__":
    asyncio.run(main())
