"""Durable sessions: checkpoint, resume, incremental and fork figures beside the same data's peers.

    python benchmarks/checkpoint.py [--sizes 64,256,512] [--forks 10] [--repeat 3] [--no-store-bench]

Starts its own KeepState server (own data dir, local store, shared template cache). For each
size, a sandbox holds that much random state in a live process; then, with the stock e2b SDK:
  * pause (freeze + checkpoint + ingest + publish) and resume times: the resume thaws the frozen
    standby the pause leaves behind (serve --standby-seconds),
  * stored bytes of the checkpoint, and of a second one after the program changed 1 MiB (manifest
    included), beside the bytes of the image that really changed (4 KiB pages new since the first),
and beside them, measured in the same run on the same image:
  * `runsc checkpoint` + `runsc restore` alone, on a local folder (gVisor with no store),
  * `restic backup` / `restic restore` of the same image folder (stored bytes and times).
Then the same pause + resume on a server with no standby (the resume materialises, verifies and
restores from the store); fork of --forks copies; and (unless --no-store-bench) benchmarks/store.py's
ingest and verified-restore throughput beside restic. Goals (issue 3): pause+resume of 256 MiB under
1 s, incremental checkpoints under 2x the bytes changed, fork of 10 under 3 s.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import KEEPSTATE, REPO, row, server  # noqa: E402

MiB = 1 << 20
HOLD = ("import os,time\nb=bytearray(os.urandom({n}<<20))\nopen('/tmp/ready','w').write('1')\n"
        "while True:\n  time.sleep(0.05)\n  if os.path.exists('/tmp/poke'):\n"
        "    os.unlink('/tmp/poke'); b[:1<<20]=os.urandom(1<<20); open('/tmp/poked','w').write('1')\n"
        "  if os.path.exists('/tmp/refill'):\n"
        "    os.unlink('/tmp/refill')\n    for i in range(0, len(b), 16<<20): b[i:i+(16<<20)]=os.urandom(16<<20)\n"
        "    open('/tmp/refilled','w').write('1')\n")


def restic(*args: str, repo: Path, env: dict[str, str]) -> float:
    t = time.perf_counter()
    subprocess.run(["restic", "-r", str(repo), "--no-cache", "-q", *args], check=True, env=env,
                   capture_output=True)
    return time.perf_counter() - t


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def checkpoints(srv) -> list[dict]:
    out = subprocess.check_output([str(KEEPSTATE), "checkpoint", "ls", "--json"], env=srv.env())
    return json.loads(out)


def wait_file(sbx, path: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not sbx.files.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.2)


def raw_runsc(srv, sandbox_id: str, work: Path) -> tuple[float, float, Path]:
    """runsc checkpoint --leave-running and runsc restore of the same sandbox, no store involved."""
    sys.path.insert(0, str(REPO))
    import asyncio

    from keepstate.db.engine import Database
    from keepstate.db.url import default_url
    from keepstate.runtime.base import Handle, Limits, SandboxSpec, TemplateRoot
    from keepstate.runtime.gvisor import GVisorRuntime
    from keepstate.sandbox.rows import SandboxRows
    from keepstate.template.builder import latest

    async def read_row():  # type: ignore[no-untyped-def]  # a SandboxRow, or None
        db = await Database.open(default_url(srv.home))  # the server's own database, read beside it (WAL)
        try:
            return await SandboxRows(db).get(sandbox_id)
        finally:
            await db.close()

    row_ = asyncio.run(read_row())
    rt = GVisorRuntime(srv.home / "sandboxes")
    image = work / "raw-image"
    t = time.perf_counter()
    rt.checkpoint(Handle(row_.runtime_name, row_.slot), image, leave_running=True)
    ckpt = time.perf_counter() - t
    b = latest("base")
    spec = SandboxSpec(name=f"bench-raw-{os.getpid()}", template=TemplateRoot("base", b.digest, b.rootfs),
                       limits=Limits(cpu=row_.cpu, memory_mb=row_.memory_mb, disk_mb=row_.settings.disk_mb))
    t = time.perf_counter()
    h = rt.restore(spec, image, slot=16000 + os.getpid() % 300)
    rest = time.perf_counter() - t
    rt.destroy(h)
    return ckpt, rest, image


def ask(sbx, request: str, done: str) -> None:
    """Have the holding program act on /tmp/<request>; wait until it says /tmp/<done>."""
    sbx.files.write(f"/tmp/{request}", "1")
    wait_file(sbx, f"/tmp/{done}")
    sbx.files.remove(f"/tmp/{done}")


def pause_resume(srv, sbx):
    """Pause with the SDK, then resume (connect): (the resumed sandbox, pause s, resume s, the pause's checkpoint)."""
    from e2b import Sandbox

    before = {c["checkpoint_id"] for c in checkpoints(srv)}
    t = time.perf_counter()
    sbx.pause()
    pause_s = time.perf_counter() - t
    t = time.perf_counter()
    resumed = Sandbox.connect(sbx.sandbox_id)
    resume_s = time.perf_counter() - t
    return resumed, pause_s, resume_s, [c for c in checkpoints(srv) if c["checkpoint_id"] not in before][-1]


def holding(srv, n: int):
    """A sandbox whose process holds n MiB of random bytes (incompressible: the worst case for a store)."""
    from e2b import Sandbox

    created = srv.api("POST", "/v2/sandboxes", {"templateID": "base", "timeout": 900,
                                                 "memoryMB": max(512, n * 2 + 256)})
    sbx = Sandbox.connect(created["sandboxID"])  # type: ignore[index]
    sbx.files.write("/tmp/hold.py", HOLD.format(n=n))
    sbx.commands.run("nohup python3 /tmp/hold.py >/dev/null 2>&1 &")
    wait_file(sbx, "/tmp/ready")
    return sbx


def increment(srv, first: str, second: str, work: Path) -> tuple[int, int]:
    """(bytes the second checkpoint added to the store, manifest included; bytes of its image that changed)."""
    sys.path.insert(0, str(REPO))
    from blake3 import blake3

    from keepstate.store import Repository, backend_from_url

    repo = Repository.open(backend_from_url(f"file://{srv.home / 'store'}"), create=False)
    a, b = work / "incr-a", work / "incr-b"
    repo.read_checkpoint(first, a)
    repo.read_checkpoint(second, b)
    changed = 0
    for f in sorted(b.iterdir()):
        old = a / f.name
        seen = set()
        if old.exists():
            data = old.read_bytes()
            seen = {blake3(data[i:i + 4096]).digest() for i in range(0, len(data), 4096)}
        data = f.read_bytes()
        changed += sum(min(4096, len(data) - i) for i in range(0, len(data), 4096)
                       if blake3(data[i:i + 4096]).digest() not in seen)
    shutil.rmtree(a)
    shutil.rmtree(b)
    stats = {c["checkpoint_id"]: c for c in checkpoints(srv)}[second]["stats"]
    manifest = repo.backend.load(f"manifests/{repo.manifest_id_of(second)}")
    repo.close()
    return int(stats["added_bytes"]) + len(manifest), changed


def fork_figures(srv, n: int, work: Path) -> list[str]:
    """Fork a running sandbox into n; beside it runsc checkpoint + n restores of the same sandbox."""
    from e2b import Sandbox

    lines: list[str] = []
    created = srv.api("POST", "/v2/sandboxes", {"templateID": "base", "timeout": 600})
    sbx = Sandbox.connect(created["sandboxID"])  # type: ignore[index]
    sbx.commands.run("echo forkme > /tmp/f")
    t = time.perf_counter()
    forks = sbx.fork(count=n, timeout=300)
    fork_s = time.perf_counter() - t
    ok = sum(1 for f in forks if isinstance(f, Sandbox))
    t = time.perf_counter()
    for f in forks:
        if isinstance(f, Sandbox):
            f.commands.run("true")
    first_cmds = time.perf_counter() - t
    raw_ck, raw_rs, raw_image = raw_runsc(srv, sbx.sandbox_id, work)
    for f in forks:
        if isinstance(f, Sandbox):
            f.kill()
    sbx.kill()
    lines.append(f"fork into {n} ({ok} succeeded):")
    lines.append(row(f"fork of {n} (checkpoint+ingest+restores)", fork_s * 1000,
                     (raw_ck + n * raw_rs) * 1000, peer_name="runsc ckpt+N restores"))
    lines.append(f"  first command in every fork: {first_cmds * 1000:.0f} ms in all")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,256,512")
    ap.add_argument("--forks", type=int, default=10, help="0: no fork figures")
    ap.add_argument("--no-store-bench", action="store_true")
    ap.add_argument("--repeat", type=int, default=3, help="pause + resume cycles per size (medians are shown)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="keepstate-ckbench-"))
    lines: list[str] = []
    renv = {**os.environ, "RESTIC_PASSWORD": "bench"}
    cold_runs: list[tuple[int, float]] = []
    raw_restore: dict[int, float] = {}
    try:
        with server(pool=0) as srv:
            srv.sdk_env()
            for n in sizes:
                sbx = holding(srv, n)

                raw_ck, raw_rs, raw_image = raw_runsc(srv, sbx.sandbox_id, work)
                image_bytes = dir_bytes(raw_image)
                raw_restore[n] = raw_rs
                repo = work / f"restic-{n}"
                restic("init", repo=repo, env=renv)
                rb = restic("backup", str(raw_image), repo=repo, env=renv)
                rstored = dir_bytes(repo)
                rr = restic("restore", "latest", "--target", str(work / f"rr-{n}"), repo=repo, env=renv)

                # pause + resume of all-new state, --repeat times (the held bytes are refilled in between)
                pauses, resumes = [], []
                for rep in range(args.repeat):
                    if rep:
                        ask(sbx, "refill", "refilled")
                    sbx, pause_s, resume_s, ckpt = pause_resume(srv, sbx)
                    pauses.append(pause_s)
                    resumes.append(resume_s)
                    if not rep:
                        stored = int(ckpt["stats"]["added_bytes"])
                pause_s, resume_s = statistics.median(pauses), statistics.median(resumes)
                total_s = statistics.median(a + b for a, b in zip(pauses, resumes, strict=True))

                incrs = []
                for _ in range(args.repeat):
                    ask(sbx, "poke", "poked")
                    sbx, p_s, r_s, second = pause_resume(srv, sbx)
                    incrs.append(p_s + r_s)
                    incr, changed = increment(srv, ckpt["checkpoint_id"], second["checkpoint_id"], work)
                    ckpt = second
                incr_s = statistics.median(incrs)
                restic("backup", str(raw_image), repo=repo, env=renv)  # same image: restic's dedupe floor
                sbx.kill()
                shutil.rmtree(raw_image, ignore_errors=True)
                cold_runs.append((n, rb + rr))

                lines.append(f"sandbox holding {n} MiB (image {image_bytes / MiB:.0f} MiB):")
                lines.append(row("pause (freeze+checkpoint+ingest+publish)", pause_s * 1000, raw_ck * 1000,
                                 peer_name="runsc checkpoint only"))
                lines.append(row("resume (thaw of the standby)", resume_s * 1000, raw_rs * 1000,
                                 peer_name="runsc restore only"))
                each = ", ".join(f"{(a + b) * 1000:.0f}" for a, b in zip(pauses, resumes, strict=True))
                lines.append(f"  (medians of {args.repeat}; pause + resume each time: {each} ms)")
                lines.append(row("pause + resume", total_s * 1000, (rb + rr) * 1000,
                                 peer_name="restic backup+restore"))
                lines.append(row("pause + resume after a 1 MiB change", incr_s * 1000, (rb + rr) * 1000,
                                 peer_name="restic backup+restore"))
                lines.append(row("stored bytes", stored / MiB, rstored / MiB, unit="MiB", peer_name="restic repo"))
                lines.append(row("stored after a 1 MiB change (+manifest)", incr / MiB, changed / MiB, unit="MiB",
                                 peer_name="image bytes changed"))
                lines.append("    (image bytes changed: 4 KiB pages of the new image found nowhere in the previous "
                             "one; the program changed 1 MiB, the agent and runtimes the rest)")

            if args.forks > 0:
                lines += fork_figures(srv, args.forks, work)
        # The same pause + resume with no standby: the resume restores (and verifies) from the store.
        with server(pool=0, extra=("--standby-seconds", "0")) as cold:
            cold.sdk_env()
            lines.append("with no standby (serve --standby-seconds 0): resume restores from the store")
            for n, restic_s in cold_runs:
                sbx, pause_s, resume_s, _ = pause_resume(cold, holding(cold, n))
                sbx.kill()
                lines.append(row(f"{n} MiB: resume (materialise+verify+restore)", resume_s * 1000,
                                 raw_restore.get(n, float("nan")) * 1000, peer_name="runsc restore only"))
                lines.append(row(f"{n} MiB: pause + resume", (pause_s + resume_s) * 1000, restic_s * 1000,
                                 peer_name="restic backup+restore"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n".join(lines))
    print("goals: pause+resume of 256 MiB < 1 s; incremental < 2x bytes changed; fork of 10 < 3 s")
    if not args.no_store_bench:
        print("\nstore ingest and verified restore beside restic (benchmarks/store.py):", flush=True)
        subprocess.run([sys.executable, str(Path(__file__).with_name("store.py")), "--sizes", "64,512"], check=False)


if __name__ == "__main__":
    main()
