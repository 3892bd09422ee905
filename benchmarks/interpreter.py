"""Code-interpreter latency: `run_code("1+1")` round trip and sandbox create-to-first-result.

Measures, in one run, (a) `code-interpreter-v1` gVisor sandboxes of a KeepState server through
the stock e2b-code-interpreter SDK and (b) a local Jupyter kernel outside any sandbox
(jupyter_client on this host), and prints the figures side by side with their ratios.

    python benchmarks/interpreter.py            # starts its own server (free port, own data dir)
    E2B_API_URL=… E2B_SANDBOX_URL=… E2B_API_KEY=… python benchmarks/interpreter.py   # a running one

Create-to-first-result is measured for a sandbox taken from the warm pool and for one started on
demand (the pool just emptied); both count until `run_code("1+1")` returns 2, retrying while the
new sandbox's bridge is not listening yet. "first pandas+pyplot import" is the first execution of
`import pandas, matplotlib.pyplot` in a fresh sandbox (pooled) or kernel.

The local kernel runs under a host virtualenv with the template's pins (tests/interpreter/
kernel_env.py; jupyter_client is not a KeepState dependency). Only loopback traffic.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.interpreter import kernel_env, server  # noqa: E402

IMPORTS = "import pandas, matplotlib.pyplot"

LOCAL_KERNEL = r"""
import json, sys, time
from jupyter_client.manager import start_new_kernel
n, imports = int(sys.argv[1]), sys.argv[2]
t0 = time.perf_counter()
km, kc = start_new_kernel(kernel_name="python3")
def run(code):
    msg_id = kc.execute(code)
    text = None
    while True:
        msg = kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "execute_result":
            text = msg["content"]["data"]["text/plain"]
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return text
assert run("1+1") == "2"
first = time.perf_counter() - t0
samples = []
for _ in range(n):
    t = time.perf_counter(); assert run("1+1") == "2"; samples.append(time.perf_counter() - t)
t = time.perf_counter(); run(imports); first_import = time.perf_counter() - t
kc.stop_channels(); km.shutdown_kernel(now=True)
print(json.dumps({"first": first, "samples": samples, "import": first_import}))
"""


def local_kernel(python: Path, n: int) -> dict[str, object]:
    out = subprocess.run([str(python), "-c", LOCAL_KERNEL, str(n), IMPORTS], capture_output=True, text=True,
                         check=True, timeout=600, cwd=tempfile.gettempdir())
    return json.loads(out.stdout.strip().splitlines()[-1])


def first_result(sbx: object, t0: float) -> float:
    """Seconds from `t0` until `1+1` gives 2 in `sbx`, retrying while its bridge is not listening."""
    from e2b import SandboxException

    while True:
        try:
            if sbx.run_code("1+1", timeout=120).text == "2":  # type: ignore[attr-defined]
                return time.perf_counter() - t0
        except SandboxException as exc:
            if "port is not open" not in str(exc):
                raise
        if time.perf_counter() - t0 > 300:
            raise TimeoutError("no result within 300 s of the create")
        time.sleep(0.02)


def pool_waiter(home: Path | None, settle: float) -> Callable[[], None]:
    """How to wait for the warm pool: a fixed time, or (our own server) its sandbox's log line."""

    def wait() -> None:
        if home is None:
            time.sleep(settle)
            return
        deadline = time.monotonic() + 300
        seen = set(WARM_SEEN)
        while time.monotonic() < deadline:
            for log in home.glob("sandboxes/*/runsc.log"):
                if log not in seen and READY_LINE in log.read_text(errors="replace"):
                    WARM_SEEN.add(log)
                    time.sleep(3)  # the default context's background imports
                    return
            time.sleep(0.2)
        raise TimeoutError("no pooled sandbox became ready within 300 s")

    return wait


READY_LINE = "default contexts ready: "
WARM_SEEN: set[Path] = set()


def keepstate(n: int, wait_pool: Callable[[], None]) -> dict[str, object]:
    from e2b_code_interpreter import Sandbox

    wait_pool()
    t0 = time.perf_counter()
    pooled = Sandbox.create(timeout=600)
    try:
        pooled_first = first_result(pooled, t0)
        # The pool now refills in the background: the next create starts a sandbox of its own.
        t0 = time.perf_counter()
        cold = Sandbox.create(timeout=600)
        cold_create = time.perf_counter() - t0
        try:
            cold_first = first_result(cold, t0)
        finally:
            cold.kill()
        wait_pool()  # the refill's kernels starting would compete for the CPU
        samples = []
        for _ in range(n):
            t = time.perf_counter()
            assert pooled.run_code("1+1").text == "2"
            samples.append(time.perf_counter() - t)
        t = time.perf_counter()
        execution = pooled.run_code(IMPORTS, timeout=120)
        assert execution.error is None, execution.error
        first_import = time.perf_counter() - t
    finally:
        pooled.kill()
    return {"first": pooled_first, "cold": cold_first, "cold_create": cold_create, "samples": samples,
            "import": first_import}


@contextmanager
def own_server(pool_size: int) -> Iterator[tuple[str, Path]]:
    home = Path(tempfile.mkdtemp(prefix="ks-bench-interp-"))
    srv, pid = server.start(home, pool_size)
    try:
        os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url, E2B_API_KEY=srv.key,
                          NO_PROXY="127.0.0.1,localhost")
        yield srv.url, home
    finally:
        server.stop(pid)
        shutil.rmtree(home, ignore_errors=True)


def pct(samples: list[float], q: int) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1] if len(samples) > 1 else samples[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=50, help="round trips per target (default 50)")
    ap.add_argument("--settle", type=float, default=20.0,
                    help="seconds to let a running server's warm pool fill before measuring (default 20)")
    args = ap.parse_args()

    python = kernel_env.ensure() / "bin" / "python"
    if os.environ.get("E2B_API_URL") and os.environ.get("E2B_API_KEY"):
        target = os.environ["E2B_API_URL"]
        ks = keepstate(args.n, pool_waiter(None, args.settle))
    else:
        with own_server(pool_size=1) as (target, home):
            ks = keepstate(args.n, pool_waiter(home, args.settle))
    local = local_kernel(python, args.n)

    ks_s, lo_s = ks["samples"], local["samples"]
    rows = [
        ("run_code('1+1') p50 ms", pct(ks_s, 50) * 1e3, pct(lo_s, 50) * 1e3),  # type: ignore[arg-type]
        ("run_code('1+1') p95 ms", pct(ks_s, 95) * 1e3, pct(lo_s, 95) * 1e3),  # type: ignore[arg-type]
        ("create→first result, pooled s", ks["first"], local["first"]),
        ("create→first result, cold s", ks["cold"], local["first"]),
        ("  of which the create call s", ks["cold_create"], local["first"]),
        ("first pandas+pyplot import s", ks["import"], local["import"]),
    ]
    load = os.getloadavg()[0]
    print(f"keepstate: {target}; local: jupyter_client + ipykernel on this host; n={args.n}; "
          f"load average {load:.1f} on {os.cpu_count()} CPUs")
    print(f"{'metric':<32}{'keepstate':>11}{'local kernel':>14}{'ratio':>8}")
    for name, a, b in rows:
        print(f"{name:<32}{a:>11.3f}{b:>14.3f}{a / b:>8.2f}")  # type: ignore[operator]


if __name__ == "__main__":
    main()
