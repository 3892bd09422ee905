"""Reading a checkpoint back: fetch, decompress and verify every chunk, then publish the directory (R1-R4)."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from keepstate.store import ids, pack
from keepstate.store.errors import CorruptCheckpoint, CorruptObject, ObjectNotFound, ShortRead
from keepstate.store.index import Index
from keepstate.store.manifest import Manifest
from keepstate.store.pack import PackEntry

if TYPE_CHECKING:
    from keepstate.store.repository import Repository

# Neighbouring chunks of one pack are fetched in one request when the gap between them is at most this.
_MAX_GAP = 1 << 20


@dataclass
class PackPlan:
    """The chunks needed from one pack, and where each goes: (file number, offset) pairs."""

    pack_id: bytes
    chunks: dict[bytes, tuple[PackEntry, list[tuple[int, int]]]] = field(default_factory=dict)

    def spans(self, max_span: int | None = None) -> Iterator[tuple[int, int, list[PackEntry]]]:
        """Yield (start, length, entries) ranges to fetch, coalescing close chunks into ranges of at most
        `max_span` bytes (a single chunk may be longer)."""
        entries = sorted((e for e, _ in self.chunks.values()), key=lambda e: e.offset)
        group: list[PackEntry] = []
        for entry in entries:
            if group and (entry.offset - (group[-1].offset + group[-1].stored_len) > _MAX_GAP
                          or max_span is not None and entry.offset + entry.stored_len - group[0].offset > max_span):
                yield group[0].offset, group[-1].offset + group[-1].stored_len - group[0].offset, group
                group = []
            group.append(entry)
        if group:
            yield group[0].offset, group[-1].offset + group[-1].stored_len - group[0].offset, group


def plan(checkpoint_id: str, manifest: Manifest, index: Index,
         bad_indexes: list[CorruptObject]) -> dict[bytes, PackPlan]:
    """Group every chunk occurrence of the manifest by the pack that holds it."""
    plans: dict[bytes, PackPlan] = {}
    for file_no, f in enumerate(manifest.files):
        for offset, run in f.chunk_offsets():
            location = index.get(run.chunk_id)
            if location is None:
                if bad_indexes:
                    bad = bad_indexes[0]
                    raise CorruptCheckpoint(checkpoint_id, "index", bad.name,
                                            f"{bad.reason}; chunk {run.chunk_id.hex()} is in no intact index")
                raise CorruptCheckpoint(checkpoint_id, "chunk", run.chunk_id.hex(), "not found in any index")
            p = plans.setdefault(location.pack_id, PackPlan(location.pack_id))
            _, targets = p.chunks.setdefault(run.chunk_id, (location.entry, []))
            targets.extend((file_no, offset + i * run.raw_len) for i in range(run.repeat))
    return plans


def fetch_verified(repo: Repository, checkpoint_id: str, pack_id: bytes, start: int, length: int,
                   entries: list[PackEntry]) -> Iterator[tuple[PackEntry, memoryview, bytes | memoryview]]:
    """Load a span of a pack and yield each of its chunks: (entry, stored bytes, verified raw bytes)."""
    name = pack_id.hex()
    try:
        data = memoryview(repo.backend.load(repo.pack_key(pack_id), start, length))
    except ObjectNotFound as exc:
        raise CorruptCheckpoint(checkpoint_id, "pack", name, "missing from the store") from exc
    except ShortRead as exc:
        raise CorruptCheckpoint(checkpoint_id, "pack", name, f"truncated: {exc}") from exc
    for entry in entries:
        stored = data[entry.offset - start:entry.offset - start + entry.stored_len]
        try:
            raw = pack.decode_chunk(entry, stored)
        except ValueError as exc:
            raise CorruptCheckpoint(checkpoint_id, "pack", name,
                                    f"chunk {entry.chunk_id.hex()} at offset {entry.offset}: {exc}") from exc
        yield entry, stored, raw


def restore(repo: Repository, manifest: Manifest, index: Index, bad_indexes: list[CorruptObject],
            dest_dir: Path, workers: int) -> None:
    checkpoint_id = manifest.checkpoint_id
    dest_dir = Path(dest_dir).absolute()
    if dest_dir.exists() and (not dest_dir.is_dir() or any(dest_dir.iterdir())):
        raise FileExistsError(f"restore destination {dest_dir} exists and is not an empty directory")
    plans = plan(checkpoint_id, manifest, index, bad_indexes)
    dest_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest_dir.parent / f".{dest_dir.name}.restoring-{secrets.token_hex(6)}"
    tmp.mkdir()
    fds: list[int] = []
    try:
        for f in manifest.files:
            path = tmp / f.name
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            fds.append(fd)
            # Pre-sized and sparse: zero chunks are verified but never written, so they stay holes.
            os.ftruncate(fd, f.size)

        def restore_span(p: PackPlan, start: int, length: int, entries: list[PackEntry]) -> None:
            for entry, _stored, raw in fetch_verified(repo, checkpoint_id, p.pack_id, start, length, entries):
                if entry.chunk_id == ids.zero_chunk_id(entry.raw_len):
                    continue
                for file_no, offset in p.chunks[entry.chunk_id][1]:
                    os.pwrite(fds[file_no], raw, offset)

        # A task per range, not per pack: a small checkpoint's one pack is still read by every worker.
        with ThreadPoolExecutor(workers, thread_name_prefix="ks-restore") as pool:
            futures = [pool.submit(restore_span, p, *span)
                       for p in plans.values() for span in p.spans(repo.backend.read_span)]
            # Without an error, FIRST_EXCEPTION returns only once every range is done.
            done, not_done = wait(futures, return_when=FIRST_EXCEPTION)
            for future in not_done:
                future.cancel()
            for future in futures:
                if future in done:
                    future.result()
        for fd, f in zip(fds, manifest.files, strict=True):
            os.fchmod(fd, f.mode)
        for fd in fds:
            os.close(fd)
        fds.clear()
        if dest_dir.exists():
            dest_dir.rmdir()
        os.rename(tmp, dest_dir)
    except BaseException:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
