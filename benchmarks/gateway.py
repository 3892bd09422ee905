"""Added latency and throughput of the metering gateway, against calling the fake provider directly and beside
the LiteLLM proxy on the same fake upstream, in the same run. All traffic stays on 127.0.0.1.

    python benchmarks/gateway.py            # from the main venv; creates/reuses .venv-bench with LiteLLM
    python benchmarks/gateway.py --no-litellm --requests 200
    python benchmarks/gateway.py --setup     # only create .venv-bench (python -m venv + pip install litellm[proxy])

Every request has a distinct body, so the gateway really goes upstream (nothing is answered from its store).
Goals (docs/design/gateway.md): under 1 ms added at p50, and at least 3x less overhead than LiteLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
BENCH_VENV = ROOT / ".venv-bench"
LITELLM_REQ = "litellm[proxy]==1.106.12"
# Any proxy-aware HTTP client in the servers under test that tries to reach beyond loopback hits a closed port.
SAFE_ENV = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost",
            "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "no_proxy": "127.0.0.1,localhost",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR"}


def setup_bench_venv() -> Path:
    litellm = BENCH_VENV / "bin" / "litellm"
    if litellm.exists():
        return litellm
    print(f"creating {BENCH_VENV} with {LITELLM_REQ} (one time)...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(BENCH_VENV)], check=True)
    subprocess.run([str(BENCH_VENV / "bin" / "pip"), "install", "-q", LITELLM_REQ], check=True)
    return litellm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_ready(url: str, proc: subprocess.Popen[bytes], limit_s: float = 90.0) -> None:
    deadline = time.monotonic() + limit_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status < 500:
                        return
            except (TimeoutError, aiohttp.ClientError):
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {limit_s}s")


def spawn(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, env={**os.environ, **SAFE_ENV, **(env or {})}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


class Target:
    def __init__(self, name: str, url: str, key: str) -> None:
        self.name, self.url, self.key = name, url, key
        self.n = 0

    def body(self, stream: bool) -> dict[str, Any]:
        self.n += 1
        return {"model": "fake-gpt", "stream": stream,
                "messages": [{"role": "user", "content": f"{self.name} request {self.n}: summarise the plan"}]}


async def one(s: aiohttp.ClientSession, t: Target, stream: bool) -> float:
    start = time.perf_counter()
    async with s.post(t.url + "/chat/completions", json=t.body(stream),
                      headers={"authorization": f"Bearer {t.key}"}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{t.name}: HTTP {r.status}")
    return time.perf_counter() - start


async def latency(t: Target, n: int, stream: bool) -> list[float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        for _ in range(min(50, n)):
            await one(s, t, stream)
        return [await one(s, t, stream) for _ in range(n)]


async def throughput(t: Target, n: int, concurrency: int) -> float:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        left = n

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await one(s, t, False)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - start)


def pct(xs: list[float], p: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1000


async def measure(requests: int, throughput_requests: int, concurrency: int, litellm: Path | None = None,
                  db: str | None = None) -> dict[str, dict[str, float]]:
    """Latency and throughput of each target: the fake provider directly, through a `keepstate gateway` on the
    database `db` (default: SQLite in a temporary data directory), and through LiteLLM if given."""
    from keepstate.db.setup import prepare
    from keepstate.db.url import default_url
    from keepstate.gateway import Gateway, GatewayConfig

    home = Path(tempfile.mkdtemp(prefix="ks-gw-bench-"))
    db = db or default_url(home)
    fake_port, gw_port, ll_port = free_port(), free_port(), free_port()
    fake_url = f"http://127.0.0.1:{fake_port}"
    cfg_doc = {"providers": [{"name": "fake", "kind": "openai", "base_url": fake_url + "/v1", "api_key": "sk-fake",
                              "models": ["fake-*"]}], "data_dir": str(home)}
    (home / "gateway.json").write_text(json.dumps(cfg_doc))
    procs = [spawn([sys.executable, "-m", "keepstate.testing.fake_provider", "--port", str(fake_port)])]
    try:
        await wait_ready(fake_url + "/_fake/stats", procs[0])
        # The token is registered from this process on the shared database, as the server would do.
        opened = await prepare(db, home)
        try:
            gw = Gateway(GatewayConfig.from_file(home / "gateway.json"), opened)
            token = await gw.register_run("bench-session", "bench-sandbox", None, None)
        finally:
            await opened.close()
        procs.append(spawn([sys.executable, "-m", "keepstate.cli.main", "gateway", "--listen",
                            f"127.0.0.1:{gw_port}", "--config", str(home / "gateway.json"), "--db", db]))
        targets = [Target("direct", fake_url + "/v1", "sk-fake"),
                   Target("keepstate", f"http://127.0.0.1:{gw_port}/v1", token)]
        await wait_ready(targets[1].url.removesuffix("/v1") + "/v1/models", procs[1])
        if litellm is not None:
            ll_cfg = home / "litellm.yaml"
            master_key = "sk-" + os.urandom(24).hex()  # LiteLLM refuses to start without one (auth on, like ours)
            ll_cfg.write_text(
                "model_list:\n  - model_name: fake-gpt\n    litellm_params:\n      model: openai/fake-gpt\n"
                f"      api_base: {fake_url}/v1\n      api_key: sk-fake\n"
                "litellm_settings:\n  telemetry: false\n  drop_params: true\n"
                f"general_settings:\n  master_key: {master_key}\n"
            )
            procs.append(spawn([str(litellm), "--config", str(ll_cfg), "--host", "127.0.0.1", "--port", str(ll_port),
                                "--num_workers", "1"]))
            await wait_ready(f"http://127.0.0.1:{ll_port}/health/liveliness", procs[-1])
            targets.append(Target("litellm", f"http://127.0.0.1:{ll_port}/v1", master_key))

        rows: dict[str, dict[str, float]] = {}
        for t in targets:
            plain = await latency(t, requests, stream=False)
            streamed = await latency(t, requests // 2, stream=True)
            rps = await throughput(t, throughput_requests, concurrency)
            rows[t.name] = {"p50": pct(plain, 0.5), "p99": pct(plain, 0.99), "stream_p50": pct(streamed, 0.5),
                            "mean": statistics.fmean(plain) * 1000, "rps": rps}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    return rows


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400, help="sequential requests per target for latency")
    ap.add_argument("--throughput-requests", type=int, default=800)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--no-litellm", action="store_true")
    ap.add_argument("--db", default=None, help="the gateway's database URL (default: SQLite in a temporary directory)")
    ap.add_argument("--setup", action="store_true", help="only create the LiteLLM venv")
    args = ap.parse_args()
    if args.setup:
        print(setup_bench_venv())
        return
    litellm = None if args.no_litellm else setup_bench_venv()
    rows = await measure(args.requests, args.throughput_requests, args.concurrency, litellm, args.db)

    d = rows["direct"]
    print(f"{'target':10} {'p50 ms':>8} {'p99 ms':>8} {'stream p50':>10} {'added p50':>10} {'added p99':>10} "
          f"{'req/s':>8} {'vs direct':>9}")
    for name, r in rows.items():
        print(f"{name:10} {r['p50']:8.3f} {r['p99']:8.3f} {r['stream_p50']:10.3f} {r['p50'] - d['p50']:10.3f} "
              f"{r['p99'] - d['p99']:10.3f} {r['rps']:8.0f} {r['rps'] / d['rps']:9.2f}")
    k = rows["keepstate"]
    k_over = max(k["p50"] - d["p50"], 1e-3)
    print(f"\nkeepstate added latency p50 {k['p50'] - d['p50']:.3f} ms (goal < 1 ms), "
          f"p99 {k['p99'] - d['p99']:.3f} ms; throughput {k['rps'] / d['rps']:.2f}x direct")
    if "litellm" in rows:
        ll = rows["litellm"]
        print(f"litellm overhead / keepstate overhead at p50: {(ll['p50'] - d['p50']) / k_over:.1f}x (goal >= 3x); "
              f"p99: {(ll['p99'] - d['p99']) / max(k['p99'] - d['p99'], 1e-3):.1f}x; "
              f"throughput keepstate/litellm: {k['rps'] / ll['rps']:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
