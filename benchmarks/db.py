"""The database layer on SQLite (the embedded default) and on PostgreSQL 15, side by side in one run:

  - state operations per second, through the code the server runs (a sandbox row written and updated, an API key
    found by its hash, a history event appended, a sandbox row read);
  - create-to-first-command p50: the stock SDK's Sandbox.create() then commands.run("true"), against a gVisor
    server on each database (warm pool of 2, as `make up` serves);
  - the metering gateway's added latency p50 (through a `keepstate gateway` on each database, against calling the
    fake provider directly; goal < 1 ms on SQLite: docs/design/gateway.md).

    python benchmarks/db.py                       # all three
    python benchmarks/db.py --ops 300 --creates 10 --gateway-requests 300
    python benchmarks/db.py --skip-sandboxes      # no gVisor needed

PostgreSQL is a throwaway cluster (keepstate.testing.postgres: Debian's postgresql 15, a Unix socket in a temporary
directory, fsync off as the tests run it), so its figures are a lower bound for a real deployment's latency.
Everything stays on loopback and Unix sockets. The ratio printed is PostgreSQL's figure over SQLite's.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import median, row, server  # noqa: E402

from keepstate.apikeys import find, issue  # noqa: E402
from keepstate.db.engine import Database  # noqa: E402
from keepstate.db.repos import History, Keys  # noqa: E402
from keepstate.db.setup import prepare  # noqa: E402
from keepstate.db.url import default_url  # noqa: E402
from keepstate.sandbox.record import SandboxRow  # noqa: E402
from keepstate.sandbox.rows import SandboxRows  # noqa: E402
from keepstate.sandbox.state import State  # noqa: E402
from keepstate.session import EventLog  # noqa: E402
from keepstate.testing.postgres import PostgresServer  # noqa: E402


async def rate(n: int, op: Callable[[int], Awaitable[object]]) -> float:
    """Operations per second of `op(i)` for i in range(n), one after another (as one request's writes are)."""
    start = time.perf_counter()
    for i in range(n):
        await op(i)
    return n / (time.perf_counter() - start)


async def operations(url: str, n: int) -> dict[str, float]:
    db = await prepare(url, Path(tempfile.mkdtemp(prefix="ks-dbbench-")))
    try:
        return await _operations(db, n)
    finally:
        await db.close()


async def _operations(db: Database, n: int) -> dict[str, float]:
    rows, keys, log = SandboxRows(db), Keys(db), EventLog(History(db))
    made = [SandboxRow(sandbox_id=f"sb{i}-{secrets.token_hex(4)}", state=State.RUNNING, template_id="base",
                       template_digest="d", runtime_name=f"ks-{i}", slot=i, address="10.88.0.2", access_token="t",
                       started_at=time.time(), end_at=time.time() + 300, cpu=1, memory_mb=512) for i in range(n)]
    _, secret = await issue(keys, "bench")
    out = {"sandbox row written (insert)": await rate(n, lambda i: rows.put(made[i]))}

    async def update(i: int) -> None:
        made[i].end_at += 60
        await rows.put(made[i])

    out["sandbox row updated (conditional)"] = await rate(n, update)
    out["sandbox row read"] = await rate(n, lambda i: rows.get(made[i].sandbox_id))
    out["API key found by hash"] = await rate(n, lambda i: find(keys, secret))
    out["history event appended"] = await rate(n, lambda i: log.append(made[i % 10].sandbox_id, "bench.event",
                                                                      {"i": i}))
    return out


def create_first_command(db: str | None, creates: int) -> float:
    """p50 ms of Sandbox.create() + commands.run("true") against a gVisor server on `db`."""
    from e2b import Sandbox

    with server(pool=2, db=db) as srv:
        srv.sdk_env()
        srv.wait_pool("base", 2)
        samples = []
        for _ in range(creates):
            start = time.perf_counter()
            sbx = Sandbox.create(timeout=120)
            sbx.commands.run("true")
            samples.append((time.perf_counter() - start) * 1000)
            sbx.kill()
            srv.wait_pool("base", 2)
        return median(samples)


async def gateway_added(db: str | None, requests: int) -> tuple[float, float]:
    """(added p50 ms, added p99 ms) of the gateway on `db` over calling the fake provider directly."""
    import gateway as gw_bench

    rows = await gw_bench.measure(requests, max(requests, 100), 8, None, db)
    d, k = rows["direct"], rows["keepstate"]
    return k["p50"] - d["p50"], k["p99"] - d["p99"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=500, help="operations of each kind per database")
    ap.add_argument("--creates", type=int, default=10, help="creates per database")
    ap.add_argument("--gateway-requests", type=int, default=300)
    ap.add_argument("--skip-sandboxes", action="store_true", help="no create-to-first-command (needs gVisor)")
    args = ap.parse_args()
    with PostgresServer() as pg:
        sqlite_url = default_url(Path(tempfile.mkdtemp(prefix="ks-dbbench-")))
        on = {"sqlite": asyncio.run(operations(sqlite_url, args.ops)),
              "postgresql": asyncio.run(operations(pg.createdb("ops"), args.ops))}
        print(f"state operations per second, one after another ({args.ops} each; ratio: PostgreSQL / SQLite)")
        for name in on["sqlite"]:
            print(row(name, on["postgresql"][name], on["sqlite"][name], "/s", "SQLite"))
        added = {"sqlite": asyncio.run(gateway_added(None, args.gateway_requests)),
                 "postgresql": asyncio.run(gateway_added(pg.createdb("gateway"), args.gateway_requests))}
        print(f"\nmetering gateway, added latency over the fake provider direct ({args.gateway_requests} requests)")
        print(row("added p50 (goal < 1 ms on SQLite)", added["postgresql"][0], added["sqlite"][0], "ms", "SQLite"))
        print(row("added p99", added["postgresql"][1], added["sqlite"][1], "ms", "SQLite"))
        if not args.skip_sandboxes:
            first = {"sqlite": create_first_command(None, args.creates),
                     "postgresql": create_first_command(pg.createdb("server"), args.creates)}
            print(f"\ncreate + first command, p50 of {args.creates} (stock SDK, gVisor, warm pool of 2)")
            print(row("Sandbox.create() + commands.run('true')", first["postgresql"], first["sqlite"], "ms",
                      "SQLite"))


if __name__ == "__main__":
    main()
