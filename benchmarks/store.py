"""Checkpoint store throughput beside restic, on the same data, in the same run.

    python benchmarks/store.py                 # 64 MiB and 512 MiB, memory-like and files-like images
    python benchmarks/store.py --sizes 64 --json

For each image: ingest throughput, stored bytes, verified-restore throughput (best of 9), the share of restore
time that verification (BLAKE3 of every chunk used) costs -- measured against the same restore with the check
patched out in this process only -- and the bytes stored by a second checkpoint after a 1 MiB in-place change.
Memory images restore sparse (zero blocks are verified once, then left as holes), hence their high restore rate.
restic (Debian's /usr/bin/restic) backs up and restores the same directory into a local repository.
All traffic is local: a directory store and a directory restic repository.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import zstandard

from keepstate.store import CheckpointMeta, ImageFile, LocalBackend, Repository, pack

MiB = 1 << 20
PAGE = 4096


@dataclass
class Result:
    tool: str
    image: str
    size: int
    ingest_s: float
    stored_bytes: int
    restore_s: float
    incremental_stored_bytes: int
    verify_s: float | None = None

    @property
    def ingest_mbps(self) -> float:
        return self.size / MiB / self.ingest_s

    @property
    def restore_mbps(self) -> float:
        return self.size / MiB / self.restore_s


def make_memory_image(path: Path, size: int, seed: int) -> None:
    """Memory-like: 75 % zero pages, 20 % random pages, 5 % repeated text pages, in runs like a real heap."""
    rnd = random.Random(seed)
    text = (b"GET /api/v1/items?page=%d HTTP/1.1\r\n" % seed) * 200
    with open(path, "wb") as f:
        written = 0
        while written < size:
            run = min(rnd.choice((1, 4, 16, 64)) * PAGE, size - written)
            r = rnd.random()
            if r < 0.75:
                f.write(bytes(run))
            elif r < 0.95:
                f.write(os.urandom(run))
            else:
                f.write((text * (run // len(text) + 1))[:run])
            written += run


def make_files_image(root: Path, size: int, seed: int) -> list[Path]:
    """Files-like: a tree of 1-8 MiB files, half text-like (compressible), half random (binaries, archives)."""
    rnd = random.Random(seed)
    words = [b"word%d" % i for i in range(2000)]
    paths = []
    written = 0
    while written < size:
        n = min(rnd.randint(1, 8) * MiB, size - written)
        path = root / f"dir{len(paths) % 7}" / f"file{len(paths)}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        if len(paths) % 2:
            path.write_bytes(os.urandom(n))
        else:
            line = b" ".join(rnd.choice(words) for _ in range(4000)) + b"\n"
            path.write_bytes((line * (n // len(line) + 1))[:n])
        paths.append(path)
        written += n
    return paths


def change_1mib(path: Path) -> None:
    """Overwrite 1 MiB in place, page aligned, in the middle of the file."""
    offset = (path.stat().st_size // 2) // PAGE * PAGE
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(os.urandom(MiB))


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def drop_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _decode_unverified(entry: pack.PackEntry, stored: bytes | memoryview) -> bytes | memoryview:
    """decode_chunk without the BLAKE3 check: only for measuring what verification costs."""
    if entry.compression == pack.ZSTD:
        return zstandard.ZstdDecompressor().decompress(stored, max_output_size=entry.raw_len)
    return stored


def restore_seconds(repo: Repository, checkpoint_id: str, dest: Path, runs: int = 9) -> tuple[float, float]:
    """Best-of-`runs` restore time with verification, and the same restore with the chunk check patched out
    (benchmark only: the store has no way to skip it). Interleaved, so load changes hit both alike."""
    verified, unverified = [], []
    real = pack.decode_chunk
    for _ in range(runs):
        for check, times in ((True, verified), (False, unverified)):
            pack.decode_chunk = real if check else _decode_unverified  # type: ignore[assignment]
            try:
                t = time.perf_counter()
                repo.read_checkpoint(checkpoint_id, dest)
                times.append(time.perf_counter() - t)
            finally:
                pack.decode_chunk = real  # type: ignore[assignment]
            drop_dir(dest)
    return min(verified), min(unverified)


def bench_keepstate(name: str, src: Path, kind: str, size: int, work: Path, changed: Path) -> Result:
    store = work / "ks-store"
    repo = Repository.open(LocalBackend(store))
    files = [ImageFile(str(p.relative_to(src)), p, kind) for p in sorted(src.rglob("*")) if p.is_file()]
    t = time.perf_counter()
    first = repo.write_checkpoint(files, CheckpointMeta(session_id="bench"))
    ingest = time.perf_counter() - t
    stored = repo.stored_bytes()
    restore, unverified = restore_seconds(repo, first.checkpoint_id, work / "ks-restore")
    verify = max(0.0, restore - unverified)
    change_1mib(changed)
    repo.write_checkpoint(files, CheckpointMeta(session_id="bench", parent_id=first.checkpoint_id))
    incremental = repo.stored_bytes() - stored
    drop_dir(store)
    return Result("keepstate", name, size, ingest, stored, restore, incremental, verify)


def bench_restic(name: str, src: Path, size: int, work: Path, changed: Path) -> Result:
    repo = work / "restic-repo"
    env = {**os.environ, "RESTIC_PASSWORD": "benchmark", "RESTIC_REPOSITORY": str(repo),
           "RESTIC_CACHE_DIR": str(work / "restic-cache")}

    def restic(*args: str) -> None:
        subprocess.run(["restic", "--quiet", *args], env=env, check=True, stdout=subprocess.DEVNULL)

    restic("init")
    base = dir_bytes(repo)
    t = time.perf_counter()
    restic("backup", str(src))
    ingest = time.perf_counter() - t
    stored = dir_bytes(repo) - base
    dest = work / "restic-restore"
    restores = []
    for _ in range(3):  # best of 3, as for keepstate
        t = time.perf_counter()
        restic("restore", "latest", "--target", str(dest))
        restores.append(time.perf_counter() - t)
        drop_dir(dest)
    restore = min(restores)
    change_1mib(changed)
    before = dir_bytes(repo)
    restic("backup", str(src))
    incremental = dir_bytes(repo) - before
    drop_dir(repo)
    drop_dir(work / "restic-cache")
    return Result("restic", name, size, ingest, stored, restore, incremental)


def run(sizes: list[int], work_root: Path) -> list[tuple[Result, Result | None]]:
    have_restic = shutil.which("restic") is not None
    if not have_restic:
        print("restic not found: install Debian's restic for the comparison", file=sys.stderr)
    rows = []
    for size_mib in sizes:
        for shape in ("memory", "files"):
            name = f"{shape}-{size_mib}MiB"
            work = Path(tempfile.mkdtemp(prefix=f"ks-bench-{name}-", dir=work_root))
            try:
                src = work / "src"
                src.mkdir()
                if shape == "memory":
                    make_memory_image(src / "pages.img", size_mib * MiB, seed=size_mib)
                    changed = src / "pages.img"
                else:
                    changed = make_files_image(src, size_mib * MiB, seed=size_mib)[0]
                pristine = changed.read_bytes()
                print(f"running {name} ...", file=sys.stderr)
                ks = bench_keepstate(name, src, "memory" if shape == "memory" else "file", size_mib * MiB,
                                     work, changed)
                rs = None
                if have_restic:
                    changed.write_bytes(pristine)  # same starting data for restic
                    rs = bench_restic(name, src, size_mib * MiB, work, changed)
                rows.append((ks, rs))
            finally:
                drop_dir(work)
    return rows


def ratio(a: float, b: float | None) -> str:
    return f"{a / b:5.2f}x" if b else "   - "


def report(rows: list[tuple[Result, Result | None]]) -> str:
    lines = [
        ("image             | ingest MB/s (ks, restic, ks/restic) | restore MB/s verified (ks, restic, ks/restic) "
         "| verify share | stored MiB (ks, restic) | after 1 MiB change: stored KiB (ks, restic)"),
    ]
    for ks, rs in rows:
        share = (ks.verify_s or 0) / ks.restore_s
        lines.append(
            f"{ks.image:<17} | {ks.ingest_mbps:7.0f} {rs.ingest_mbps if rs else 0:7.0f} "
            f"{ratio(ks.ingest_mbps, rs.ingest_mbps if rs else None)}        "
            f"| {ks.restore_mbps:7.0f} {rs.restore_mbps if rs else 0:7.0f} "
            f"{ratio(ks.restore_mbps, rs.restore_mbps if rs else None)}                "
            f"| {share:10.0%}   | {ks.stored_bytes / MiB:8.1f} {(rs.stored_bytes if rs else 0) / MiB:8.1f}   "
            f"| {ks.incremental_stored_bytes / 1024:8.0f} {(rs.incremental_stored_bytes if rs else 0) / 1024:8.0f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64,512", help="image sizes in MiB, comma separated")
    parser.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()), help="where to put the data")
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON")
    args = parser.parse_args()
    rows = run([int(s) for s in args.sizes.split(",")], args.tmp)
    if args.json:
        print(json.dumps([{"keepstate": {**asdict(ks), "ingest_mbps": ks.ingest_mbps,
                                         "restore_mbps": ks.restore_mbps},
                           "restic": ({**asdict(rs), "ingest_mbps": rs.ingest_mbps,
                                       "restore_mbps": rs.restore_mbps} if rs else None)}
                          for ks, rs in rows], indent=2))
    else:
        print(report(rows))


if __name__ == "__main__":
    main()
