"""Writing a checkpoint: chunk, hash, dedupe against the index, compress, pack, store (rules W1-W6)."""

from __future__ import annotations

import os
import stat
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from keepstate.store import ids, pack
from keepstate.store.chunker import chunks_of
from keepstate.store.index import Index, PackRecord
from keepstate.store.manifest import FileEntry, ImageFile, Run, check_file_name

if TYPE_CHECKING:
    from keepstate.store.lock import Lock
    from keepstate.store.repository import Repository

# Chunks per task for the thread pool (hash, index lookup, compression), and tasks queued at once: 64 chunks
# (2 MiB at the usual 32 KiB) per task keeps the per-task overhead small; 8 tasks in flight keep both cores busy.
_GROUP = 64
_GROUPS_IN_FLIGHT = 8
# Packs being stored while the next one fills; bounds memory to about (_IN_FLIGHT + 1) × pack size.
_IN_FLIGHT = 3

PackSink = Callable[[bytes, "list[bytes | memoryview]"], None]
# What _prepare returns for each chunk.
_Prepared = tuple[bytes, tuple[bytes | memoryview, int] | None]


class PackWriter:
    """Gathers stored chunks into packs and hands each full pack to `sink(pack_id, data)`.

    With `background=True` the sink runs in a separate thread so that storing one pack overlaps filling the next.
    """

    def __init__(self, sink: PackSink, target_size: int, background: bool = True,
                 on_pack: Callable[[], None] | None = None) -> None:
        self._sink = sink
        self._target = target_size
        self._builder = pack.PackBuilder()
        self._chunks: set[bytes] = set()
        self._executor = ThreadPoolExecutor(_IN_FLIGHT, thread_name_prefix="ks-pack") if background else None
        self._pending: list[Future[PackRecord]] = []
        self._on_pack = on_pack
        self.records: list[PackRecord] = []
        self.stored_bytes = 0

    def __contains__(self, chunk_id: bytes) -> bool:
        return chunk_id in self._chunks

    def add(self, chunk_id: bytes, stored: bytes | memoryview, raw_len: int, compression: int) -> None:
        if chunk_id in self._chunks:
            return
        self._chunks.add(chunk_id)
        self._builder.add(chunk_id, stored, raw_len, compression)
        self.stored_bytes += len(stored)
        if self._builder.size >= self._target:
            self.flush()

    def flush(self) -> None:
        if not len(self._builder):
            return
        builder, self._builder = self._builder, pack.PackBuilder()
        if self._executor is None:
            self.records.append(self._store(builder))
        else:
            while len(self._pending) >= _IN_FLIGHT:
                self.records.append(self._pending.pop(0).result())
            self._pending.append(self._executor.submit(self._store, builder))
        if self._on_pack is not None:
            self._on_pack()

    def _store(self, builder: pack.PackBuilder) -> PackRecord:
        pack_id, parts = builder.finish_parts()  # hashing 16 MiB: off the chunking thread
        self._sink(pack_id, parts)
        return PackRecord(pack_id, sum(len(p) for p in parts), tuple(builder.entries))

    def finish(self) -> list[PackRecord]:
        """Store the last pack and wait until every pack is stored; return what was stored."""
        try:
            self.flush()
            while self._pending:
                self.records.append(self._pending.pop(0).result())
        finally:
            self.close()
        return self.records

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


@dataclass
class IngestStats:
    chunks: int = 0
    unique_chunks: int = 0
    added_chunks: int = 0
    added_bytes: int = 0


def _prepare(chunks: list[memoryview], index: Index, level: int) -> list[_Prepared]:
    """In a worker: each chunk's ID, and its stored form (bytes, compression) unless the index holds it."""
    out: list[_Prepared] = []
    for chunk in chunks:
        chunk_id = ids.digest(chunk)
        out.append((chunk_id, None if chunk_id in index else pack.compress(chunk, level)))
    return out


def ingest_file(image: ImageFile, repo: Repository, index: Index, writer: PackWriter,
                pool: ThreadPoolExecutor, stats: IngestStats, seen: set[bytes]) -> FileEntry:
    """Chunk one image file, store the chunks neither the index nor this write holds, and return its file entry."""
    check_file_name(image.name)
    st = os.stat(image.path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"image file {image.path} is not a regular file")
    level = repo.config.zstd_level
    runs: list[Run] = []
    size = 0
    pending: deque[tuple[list[memoryview], Future[list[_Prepared]]]] = deque()

    def collect() -> None:
        nonlocal size
        group, future = pending.popleft()
        for chunk, (chunk_id, stored) in zip(group, future.result(), strict=True):
            size += len(chunk)
            stats.chunks += 1
            if runs and runs[-1].chunk_id == chunk_id:
                last = runs[-1]
                runs[-1] = Run(chunk_id, last.raw_len, last.repeat + 1)
            else:
                runs.append(Run(chunk_id, len(chunk)))
            if chunk_id in seen:
                continue
            seen.add(chunk_id)
            stats.unique_chunks += 1
            if stored is not None:
                writer.add(chunk_id, stored[0], len(chunk), stored[1])
                stats.added_chunks += 1
                stats.added_bytes += len(stored[0])

    group: list[memoryview] = []
    for chunk in chunks_of(image.path, image.kind, repo.config.chunker):
        group.append(chunk)
        if len(group) >= _GROUP:
            pending.append((group, pool.submit(_prepare, group, index, level)))
            group = []
            if len(pending) >= _GROUPS_IN_FLIGHT:
                collect()
    if group:
        pending.append((group, pool.submit(_prepare, group, index, level)))
    while pending:
        collect()
    if size != st.st_size:
        raise ValueError(f"image file {image.path} changed while it was being stored "
                         f"({st.st_size} bytes before, {size} read)")
    return FileEntry(image.name, image.kind, stat.S_IMODE(st.st_mode), size, tuple(runs))


def ingest(repo: Repository, images: Iterable[ImageFile], index: Index, lock: Lock | None,
           workers: int) -> tuple[list[FileEntry], list[PackRecord], IngestStats]:
    """Store the chunks of every image file (packs only: the caller writes index, manifest and ref)."""
    stats = IngestStats()
    seen: set[bytes] = set()
    writer = PackWriter(repo.save_pack, repo.config.pack_target_size,
                        on_pack=lock.refresh if lock is not None else None)
    entries = []
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="ks-ingest") as pool:
            for image in images:
                entries.append(ingest_file(image, repo, index, writer, pool, stats, seen))
        records = writer.finish()
    finally:
        writer.close()
    return entries, records, stats
