"""Templates from the stock SDK's `Template()`: cold and cached builds beside `docker build`'s work, and creates.

    python benchmarks/template.py [--count 10] [--pool 10] [--template-pool 1]

Starts its own KeepState server (free port, own data dir, the shared template cache, `--egress off` outside an
isolated namespace), then with the stock e2b SDK:
  * builds a 4-step template `from_base_image()`: COPY a small folder, RUN a shell step that writes files (no
    network: no pip, no apt), ENV, WORKDIR, and a start command with its ready command. The folder carries a
    fresh nonce, so the first build is cold (no step in the cache); the second, identical, build must take every
    step from the cache (its `CACHED [` log lines are counted and printed);
  * create-to-first-command (`Sandbox.create(t)` then `commands.run("true")`), --count times each from the custom
    template and from `base`, alternated, each sandbox killed before the next, each create after its template's
    warm pool refilled (`base`: --pool booted sandboxes; the custom template: --template-pool restored from its
    snapshot, started by its first create, which is timed apart); p50 and p95.
The peer, measured in the same run, is the same work done the way `docker build` does it, on gVisor:
  * cold: unpack the `base` template's root filesystem into a fresh directory (a tar pipe), COPY the folder in
    (host side, as docker's COPY), RUN the step with `runsc --network=none --platform=systrap do` in that
    directory (writes land in it, as in a layer), WORKDIR as `mkdir -p`, ENV as metadata only, and the start
    command run with its ready check polled in one more `runsc do` (docker build runs no start command; KeepState
    runs it and snapshots the sandbox once it is ready, so this is the nearest equal work);
  * cached: docker's cache check: hash the context and every step into a chain of keys and find the layer.
Goal (issue 13): create-to-first-command p50 from the custom template within 10 % of `base`'s.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import TEMPLATE_CACHE, median, pct, row, server  # noqa: E402

SHIM = "mount --make-rprivate / && mount -t tmpfs none /proc/sys/net && exec \"$@\""
RUN_STEP = ("mkdir -p /home/user/gen && for i in $(seq 1 200); do echo \"line $i\" > /home/user/gen/f$i; done"
            " && ls -R /home/user/bench > /home/user/gen/listing && cat /home/user/bench/nonce >> /home/user/gen/f1")
ENVS = {"BENCH_GREETING": "hello"}
WORKDIR = "/home/user/work"
READY_FILE = "/tmp/bench-ready"
START = f"sh -c 'touch {READY_FILE}; exec sleep infinity'"


def context(root: Path, nonce: str) -> Path:
    """A small folder to COPY: 20 files in two directories, one of them the nonce that makes the build cold."""
    ctx = root / "ctx"
    for d in ("bench", "bench/sub"):
        (ctx / d).mkdir(parents=True)
        for i in range(10):
            (ctx / d / f"file{i}.txt").write_text(f"{d} {i}\n" * 50)
    (ctx / "bench" / "nonce").write_text(nonce + "\n")
    return ctx


def template(ctx: Path) -> Any:
    from e2b import Template, wait_for_file

    return (Template(file_context_path=str(ctx))
            .from_base_image()
            .copy("bench", "/home/user/bench/")
            .run_cmd(RUN_STEP)
            .set_envs(ENVS)
            .set_workdir(WORKDIR)
            .set_start_cmd(START, wait_for_file(READY_FILE)))


def build(ctx: Path, name: str) -> tuple[float, list[str]]:
    from e2b import Template

    logs: list[Any] = []
    os.sync()  # as before the peer
    t = time.perf_counter()
    Template.build(template(ctx), name, on_build_logs=logs.append)  # the SDK's default CPU and memory
    return (time.perf_counter() - t) * 1000, [str(e.message) for e in logs]


def runsc_do(rootfs: Path, script: str) -> None:
    """One step in a fresh gVisor sandbox whose root is `rootfs`, written in place (no overlay), as a layer."""
    subprocess.run(["unshare", "-m", "--", "sh", "-c", SHIM, "sh", "runsc", "--network=none", "--platform=systrap",
                    "--root=/run/keepstate/bench-runsc", "do", f"-root={rootfs}", "-force-overlay=false",
                    "-cwd=/", "-quiet", "sh", "-c", script], check=True, capture_output=True)


def peer_cold(base_rootfs: Path, ctx: Path, work: Path) -> tuple[float, float, Path]:
    """(unpack ms, steps ms, the built rootfs) of the template's steps done the way `docker build` does them."""
    work.mkdir()
    rootfs = work / "rootfs"
    os.sync()  # no earlier run's dirty pages throttle this one's writes
    t = time.perf_counter()
    rootfs.mkdir()
    # tar, as docker unpacks a layer: on this host `cp -a` of the same tree was 5-7x slower (slow file creates)
    subprocess.run(f"tar -C {shlex.quote(str(base_rootfs))} -cf - . | tar -C {shlex.quote(str(rootfs))} "
                   "--numeric-owner -xpf -", shell=True, check=True)
    unpacked = time.perf_counter()
    dest = rootfs / "home/user/bench"
    subprocess.run(["cp", "-a", str(ctx / "bench"), str(dest)], check=True)  # COPY
    st = (rootfs / "home/user").stat()
    subprocess.run(["chown", "-R", f"{st.st_uid}:{st.st_gid}", str(dest)], check=True)  # COPY's owner: the user
    runsc_do(rootfs, RUN_STEP)  # RUN
    (rootfs / WORKDIR.lstrip("/")).mkdir(parents=True, exist_ok=True)  # WORKDIR; ENV is image metadata
    runsc_do(rootfs, f"cd {WORKDIR} && {{ {START} & }}; until [ -f {READY_FILE} ]; do sleep 0.05; done; kill $!")
    done = time.perf_counter()
    if not (rootfs / "home/user/gen/f200").is_file():
        raise RuntimeError("the peer's RUN step wrote nothing")
    return (unpacked - t) * 1000, (done - unpacked) * 1000, rootfs


def peer_keys(ctx: Path) -> list[str]:
    """Docker's cache keys for the same 4 steps: a chain over the context's bytes and the steps' text."""
    key = hashlib.sha256(b"base").hexdigest()
    h = hashlib.sha256()
    for p in sorted((ctx / "bench").rglob("*")):
        h.update(str(p.relative_to(ctx)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    keys = []
    for step in (f"COPY {h.hexdigest()}", f"RUN {RUN_STEP}", f"ENV {ENVS}", f"WORKDIR {WORKDIR}", f"CMD {START}"):
        key = hashlib.sha256((key + step).encode()).hexdigest()
        keys.append(key)
    return keys


def peer_cached(ctx: Path, layers: Path) -> float:
    """Docker's cache check for the same 4 steps: the key chain, and a stored layer for each key."""
    t = time.perf_counter()
    for key in peer_keys(ctx):
        if not (layers / key).exists():
            raise RuntimeError("the peer's cache has no layer for a step")
    return (time.perf_counter() - t) * 1000


def peer_layers(ctx: Path, layers: Path) -> None:
    """Record the peer's layers (empty marker directories: the cold build's rootfs stands for all of them)."""
    for key in peer_keys(ctx):
        (layers / key).mkdir(parents=True)


def create_first(template_id: str) -> float:
    from e2b import Sandbox

    t = time.perf_counter()
    sbx = Sandbox.create(template_id, timeout=120)
    sbx.commands.run("true")
    took = (time.perf_counter() - t) * 1000
    sbx.kill()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=10, help="creates to time from each template")
    ap.add_argument("--pool", type=int, default=10, help="warm pool of `base` sandboxes (the server's --pool-size)")
    ap.add_argument("--template-pool", type=int, default=1,
                    help="warm pool of the built template (the server's --template-pool-size; 0: every create "
                         "restores its snapshot)")
    args = ap.parse_args()

    os.environ.setdefault("KEEPSTATE_TEMPLATE_CACHE", TEMPLATE_CACHE)
    from keepstate.template.builder import latest

    base = latest("base")
    if base is None:
        raise SystemExit("no `base` template is built here: run `keepstate template build base` first")
    work = Path(tempfile.mkdtemp(prefix="keepstate-bench-tpl-", dir="/var/tmp"))
    name = f"bench-tpl-{uuid.uuid4().hex[:8]}"
    try:
        ctx = context(work, uuid.uuid4().hex)
        unpack_ms, steps_ms, _ = peer_cold(base.rootfs, ctx, work / "peer")
        peer_layers(ctx, work / "layers")
        cached_peer = median([peer_cached(ctx, work / "layers") for _ in range(5)])
        with server(pool=args.pool, extra=("--template-pool-size", str(args.template_pool))) as srv:
            srv.sdk_env()
            cold_ms, cold_logs = build(ctx, name)
            warm_ms, warm_logs = build(ctx, name)
            ran_cold = sum(1 for m in cold_logs if m.startswith("CACHED ["))
            cached = sum(1 for m in warm_logs if m.startswith("CACHED ["))
            steps = max((int(x) for m in cold_logs for x in re.findall(r"^\[\d+/(\d+)\]", m)), default=0)
            srv.wait_pool("base", args.pool)
            custom: list[float] = []
            plain: list[float] = []
            first_custom = create_first(name)  # printed apart: the first restore of a new template reads its
            srv.wait_pool("base", args.pool)  # snapshot from the store into the page cache, as any first use does
            first_base = create_first("base")
            for _ in range(args.count):
                srv.wait_pool("base", args.pool)
                if args.template_pool:
                    srv.wait_pool(name, args.template_pool)
                custom.append(create_first(name))
                srv.wait_pool("base", args.pool)
                plain.append(create_first("base"))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    peer_cold_ms = unpack_ms + steps_ms
    print("Template builds (COPY, RUN, ENV, WORKDIR, start + ready; stock SDK Template().from_base_image()) "
          "vs the same steps as `docker build` does them (tar the base rootfs into a fresh dir + `runsc do`)")
    print(f"  steps from the cache: cold build {ran_cold} of {steps} (want 0), cached rebuild {cached} of {steps}")
    print(row("cold build", cold_ms, peer_cold_ms, peer_name="tar + runsc do steps"))
    print(f"  (the peer's cold build: {unpack_ms:.1f} ms unpacking the base rootfs, {steps_ms:.1f} ms the steps)")
    # docker's overlay snapshotter finds an image it already has unpacked: its build is the steps alone
    print(row("cold build vs the peer's steps alone", cold_ms, steps_ms, peer_name="runsc do steps"))
    print(row("fully cached rebuild", warm_ms, cached_peer, peer_name="docker-style cache check"))
    print(row("fully cached rebuild vs the peer's cold build", warm_ms, peer_cold_ms,
              peer_name="tar + runsc do steps"))
    cp50, bp50 = median(custom), median(plain)
    print(f"Create-to-first-command ({args.count} each, alternated; `base` from a warm pool of {args.pool}; "
          f"the custom template from a warm pool of {args.template_pool} restored from its snapshot)")
    print(row("custom template p50", cp50, bp50, peer_name="base p50"))
    print(row("custom template p95", pct(custom, 95), pct(plain, 95), peer_name="base p95"))
    print(row("the first create of each (not in the above)", first_custom, first_base, peer_name="base's first"))
    met = "met" if cp50 <= bp50 * 1.10 else "NOT MET"
    print(f"goal: custom template create-to-first-command p50 within 10 % of base's: {met}")


if __name__ == "__main__":
    main()
