"""Code-interpreter latency: `run_code("1+1")` round trip and sandbox create-to-first-result.

Measures, in one run, (a) a KeepState server through the stock e2b-code-interpreter SDK and
(b) a local Jupyter kernel outside any sandbox (jupyter_client, same machine), and prints the ratios.

    # against a KeepState server
    E2B_API_URL=http://127.0.0.1:3000 E2B_SANDBOX_URL=http://127.0.0.1:3000 E2B_API_KEY=… \\
        python benchmarks/interpreter.py
    # before sandboxes exist: the bridge on this host behind the test stub (tests/interpreter/stub.py)
    python benchmarks/interpreter.py --stub

Only loopback traffic. The local kernel runs under the kernel venv's python (tests/interpreter/
kernel_env.py, built from the template's pins) since jupyter_client is not a KeepState dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LOCAL_KERNEL = r"""
import json, sys, time
from jupyter_client.manager import start_new_kernel
n = int(sys.argv[1])
t0 = time.perf_counter()
km, kc = start_new_kernel(kernel_name="python3")
def run(code):
    msg_id = kc.execute(code)
    text = None
    while True:
        msg = kc.get_iopub_msg(timeout=30)
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
kc.stop_channels(); km.shutdown_kernel(now=True)
print(json.dumps({"first": first, "samples": samples}))
"""


def local_kernel(python: Path, n: int) -> dict:
    out = subprocess.run([str(python), "-c", LOCAL_KERNEL, str(n)], capture_output=True, text=True,
                         check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def sandbox(n: int) -> dict:
    from e2b_code_interpreter import Sandbox

    t0 = time.perf_counter()
    sbx = Sandbox.create()
    try:
        assert sbx.run_code("1+1").text == "2"
        first = time.perf_counter() - t0
        samples = []
        for _ in range(n):
            t = time.perf_counter()
            assert sbx.run_code("1+1").text == "2"
            samples.append(time.perf_counter() - t)
    finally:
        sbx.kill()
    return {"first": first, "samples": samples}


def p(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[int(q) - 1] if len(samples) > 1 else samples[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=50, help="round trips per target (default 50)")
    ap.add_argument("--stub", action="store_true", help="run the bridge on this host behind the test stub")
    args = ap.parse_args()

    from tests.interpreter import kernel_env

    venv = kernel_env.ensure()
    stub = None
    if args.stub:
        from tests.interpreter.stub import Stub

        stub = Stub(venv, Path(tempfile.mkdtemp(prefix="ks-bench-")))
        stub.start()
        os.environ.update(E2B_API_KEY="bench", E2B_API_URL=stub.url, E2B_SANDBOX_URL=stub.url)
    elif not os.environ.get("E2B_API_URL"):
        sys.exit("set E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY to a KeepState server, or pass --stub")
    try:
        ks = sandbox(args.n)
    finally:
        if stub is not None:
            stub.stop()
    local = local_kernel(venv / "bin" / "python", args.n)

    target = "bridge on host (stub)" if stub else os.environ["E2B_API_URL"]
    rows = [
        ("run_code('1+1') p50 ms", p(ks["samples"], 50) * 1e3, p(local["samples"], 50) * 1e3),
        ("run_code('1+1') p95 ms", p(ks["samples"], 95) * 1e3, p(local["samples"], 95) * 1e3),
        ("create → first result s", ks["first"], local["first"]),
    ]
    print(f"target: {target}; n={args.n}")
    print(f"{'metric':<26}{'keepstate':>12}{'local kernel':>14}{'ratio':>8}")
    for name, a, b in rows:
        print(f"{name:<26}{a:>12.2f}{b:>14.2f}{a / b:>8.2f}")


if __name__ == "__main__":
    main()
