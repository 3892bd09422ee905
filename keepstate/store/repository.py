"""The repository: the store's public face. Opens a backend, and writes, reads, lists and deletes checkpoints."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from keepstate.store import ids
from keepstate.store import index as index_mod
from keepstate.store import manifest as manifest_mod
from keepstate.store.backend import Backend
from keepstate.store.chunker import ChunkerParams
from keepstate.store.errors import (
    CheckpointExists,
    CheckpointNotFound,
    CorruptCheckpoint,
    CorruptObject,
    ObjectNotFound,
    RepositoryError,
)
from keepstate.store.index import Index, PackRecord
from keepstate.store.lock import Lock
from keepstate.store.manifest import CheckpointMeta, FileEntry, ImageFile, Manifest

if TYPE_CHECKING:
    from keepstate.store.gc import GcReport
    from keepstate.store.verify import VerifyReport

log = logging.getLogger(__name__)

FORMAT = "keepstate-checkpoint-store"
VERSION = 1
CONFIG_KEY = "config"
Progress = Callable[[int, int], None]  # (advance, total) in stored chunk bytes


def _default_workers() -> int:
    return max(2, min(8, os.cpu_count() or 2))


@dataclass(frozen=True)
class RepoConfig:
    repository_id: str = field(default_factory=lambda: secrets.token_hex(16))
    created: str = field(default_factory=lambda: dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    chunker: ChunkerParams = field(default_factory=ChunkerParams)
    pack_target_size: int = 16 << 20
    zstd_level: int = 1

    def to_json(self) -> dict[str, Any]:
        c = self.chunker
        return {"format": FORMAT, "version": VERSION, "repository_id": self.repository_id, "created": self.created,
                "memory_block_size": c.memory_block_size, "file_chunk_min": c.file_chunk_min,
                "file_chunk_avg": c.file_chunk_avg, "file_chunk_max": c.file_chunk_max,
                "pack_target_size": self.pack_target_size, "zstd_level": self.zstd_level}

    @classmethod
    def from_bytes(cls, data: bytes) -> RepoConfig:
        try:
            d = json.loads(data)
            if d.get("format") != FORMAT:
                raise RepositoryError(f"not a KeepState checkpoint store (format {d.get('format')!r})")
            if d.get("version") != VERSION:
                raise RepositoryError(f"unsupported store format version {d.get('version')}; this KeepState "
                                      f"reads version {VERSION}")
            return cls(str(d["repository_id"]), str(d["created"]),
                       ChunkerParams(int(d["memory_block_size"]), int(d["file_chunk_min"]),
                                     int(d["file_chunk_avg"]), int(d["file_chunk_max"])),
                       int(d["pack_target_size"]), int(d["zstd_level"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptObject("config", CONFIG_KEY, f"unreadable: {exc}") from exc


class Repository:
    """A checkpoint store on one backend. Thread-safe for concurrent reads; each write takes its own lock."""

    def __init__(self, backend: Backend, config: RepoConfig, cache_dir: Path | None = None,
                 workers: int | None = None) -> None:
        self.backend = backend
        self.config = config
        self.workers = workers or _default_workers()
        # Index objects and manifests are immutable and content-named, so a local copy never goes stale; it is
        # still verified on every use.
        self.cache_dir = Path(cache_dir) / config.repository_id if cache_dir is not None else None

    # -- opening -----------------------------------------------------------------------------------------------

    @classmethod
    def init(cls, backend: Backend, cache_dir: Path | None = None, config: RepoConfig | None = None) -> Repository:
        """Create a repository; fails if one already exists at the location."""
        if backend.exists(CONFIG_KEY):
            raise RepositoryError(f"a repository already exists at {backend.location}")
        config = config or RepoConfig()
        backend.save(CONFIG_KEY, json.dumps(config.to_json(), indent=2).encode())
        return cls(backend, config, cache_dir)

    @classmethod
    def open(cls, backend: Backend, cache_dir: Path | None = None, create: bool = True) -> Repository:
        """Open the repository at the backend's location, creating it on first use unless `create` is False."""
        try:
            data = backend.load(CONFIG_KEY)
        except ObjectNotFound:
            if not create:
                raise RepositoryError(f"no checkpoint store at {backend.location} (it has no config object)") from None
            try:
                return cls.init(backend, cache_dir)
            except RepositoryError:  # another process created it first
                data = backend.load(CONFIG_KEY)
        return cls(backend, RepoConfig.from_bytes(data), cache_dir)

    def close(self) -> None:
        self.backend.close()

    # -- object names and verified loading ---------------------------------------------------------------------

    @staticmethod
    def pack_key(pack_id: bytes) -> str:
        name = pack_id.hex()
        return f"packs/{name[:2]}/{name}"

    def save_pack(self, pack_id: bytes, parts: list[bytes | memoryview]) -> None:
        """Store a pack given as its consecutive parts (PackBuilder.finish_parts)."""
        self.backend.save_parts(self.pack_key(pack_id), parts)

    def _cached_load(self, kind: str, name: str, use_cache: bool) -> bytes:
        cached = self.cache_dir / kind / name if self.cache_dir is not None and use_cache else None
        if cached is not None:
            try:
                data = cached.read_bytes()
                if ids.hexdigest(data) == name:
                    return data
            except OSError:
                pass
        data = self.backend.load(f"{kind}/{name}")
        if cached is not None and ids.hexdigest(data) == name:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(f".tmp-{secrets.token_hex(6)}")
            tmp.write_bytes(data)
            os.replace(tmp, cached)
        return data

    def load_manifest(self, manifest_id: str, use_cache: bool = True) -> Manifest:
        return manifest_mod.decode(manifest_id, self._cached_load("manifests", manifest_id, use_cache))

    def load_index(self, use_cache: bool = True) -> tuple[Index, list[CorruptObject]]:
        """Merge every index object. Corrupt ones are left out and returned, so that callers decide (R4, D3)."""
        index = Index()
        bad: list[CorruptObject] = []
        names = sorted(info.key.split("/", 1)[1] for info in self.backend.list("index/"))
        for name in names:
            try:
                index.add(name, index_mod.decode(name, self._cached_load("index", name, use_cache)))
            except ObjectNotFound:
                continue  # superseded by a gc since we listed
            except CorruptObject as exc:
                log.warning("ignoring corrupt index object: %s", exc)
                bad.append(exc)
        return index, bad

    def save_index(self, records: list[PackRecord]) -> str:
        index_id, data = index_mod.encode(records)
        name = index_id.hex()
        self.backend.save(f"index/{name}", data)
        return name

    def ref_ids(self) -> list[str]:
        return sorted(info.key.split("/", 1)[1] for info in self.backend.list("refs/"))

    def manifest_id_of(self, checkpoint_id: str) -> str:
        ids.check_checkpoint_id(checkpoint_id)
        try:
            data = self.backend.load(f"refs/{checkpoint_id}")
        except ObjectNotFound:
            raise CheckpointNotFound(checkpoint_id) from None
        return manifest_mod.decode_ref(checkpoint_id, data)

    # -- checkpoints -------------------------------------------------------------------------------------------

    def write_checkpoint(self, files: list[ImageFile], meta: CheckpointMeta) -> Manifest:
        """Store the image files as a new checkpoint and publish it. Only chunks not yet in the store are written.

        Crash-safe: until the final ref is written nothing is listed, and gc reclaims what was stored.
        """
        from keepstate.store.ingest import ingest

        names = [f.name for f in files]
        if len(set(names)) != len(names):
            raise ValueError("image file names must be unique within a checkpoint")
        for f in files:
            manifest_mod.check_file_name(f.name)
            if f.kind not in manifest_mod.KINDS:
                raise ValueError(f"image file {f.name!r} has unknown kind {f.kind!r}: use 'memory' or 'file'")
        if self.backend.exists(f"refs/{meta.checkpoint_id}"):
            raise CheckpointExists(f"checkpoint {meta.checkpoint_id} already exists in {self.backend.location}")
        with Lock(self.backend, "shared", f"write checkpoint {meta.checkpoint_id}") as lock:
            index, _bad = self.load_index()
            entries, records, stats = ingest(self, files, index, lock, self.workers)
            if records:  # W2: every pack is stored before the index object that lists them
                self.save_index(records)
            size = sum(e.size for e in entries)
            meta = manifest_mod.with_stats(meta, {
                "size": size, "chunks": stats.chunks, "unique_chunks": stats.unique_chunks,
                "added_chunks": stats.added_chunks, "added_bytes": stats.added_bytes})
            return self._publish(meta, entries)

    def _publish(self, meta: CheckpointMeta, entries: list[FileEntry] | tuple[FileEntry, ...]) -> Manifest:
        data = manifest_mod.to_bytes(meta, entries)
        manifest_id = ids.hexdigest(data)
        self.backend.save(f"manifests/{manifest_id}", data)  # W3: after the index
        self.backend.save(f"refs/{meta.checkpoint_id}", manifest_mod.encode_ref(meta.checkpoint_id, manifest_id))
        return manifest_mod.decode(manifest_id, data)

    def get_manifest(self, checkpoint_id: str) -> Manifest:
        """The verified manifest of a checkpoint. Corruption raises CorruptCheckpoint naming the object."""
        try:
            manifest_id = self.manifest_id_of(checkpoint_id)
        except CorruptObject as exc:
            raise CorruptCheckpoint(checkpoint_id, exc.kind, exc.name, exc.reason) from exc
        try:
            manifest = self.load_manifest(manifest_id)
        except ObjectNotFound:
            raise CorruptCheckpoint(checkpoint_id, "manifest", manifest_id, "missing from the store") from None
        except CorruptObject as exc:
            raise CorruptCheckpoint(checkpoint_id, exc.kind, exc.name, exc.reason) from exc
        if manifest.checkpoint_id != checkpoint_id:
            raise CorruptCheckpoint(checkpoint_id, "manifest", manifest_id,
                                    f"describes checkpoint {manifest.checkpoint_id}")
        return manifest

    def read_checkpoint(self, checkpoint_id: str, dest_dir: Path) -> Manifest:
        """Materialise a checkpoint's files in `dest_dir` (absent or empty), verifying every chunk.

        On any error nothing is left in `dest_dir`; corruption raises CorruptCheckpoint naming the object.
        """
        from keepstate.store.restore import restore

        manifest = self.get_manifest(checkpoint_id)
        # Shared lock: a concurrent gc must not repack the packs we are reading.
        with Lock(self.backend, "shared", f"read checkpoint {checkpoint_id}"):
            index, bad = self.load_index()
            restore(self, manifest, index, bad, Path(dest_dir), self.workers)
        return manifest

    def list_checkpoints(self) -> list[Manifest]:
        """Every readable checkpoint, oldest first. Unreadable ones are logged and left out (verify reports them)."""
        manifests = []
        for checkpoint_id in self.ref_ids():
            try:
                manifests.append(self.get_manifest(checkpoint_id))
            except (CorruptObject, CheckpointNotFound) as exc:
                log.warning("skipping checkpoint %s: %s", checkpoint_id, exc)
        return sorted(manifests, key=lambda m: (m.meta.created, m.checkpoint_id))

    def delete_checkpoint(self, checkpoint_id: str) -> None:
        """Unpublish a checkpoint (D1). Its data is reclaimed by the next gc."""
        if not self.backend.exists(f"refs/{ids.check_checkpoint_id(checkpoint_id)}"):
            raise CheckpointNotFound(checkpoint_id)
        self.backend.remove(f"refs/{checkpoint_id}")

    def lineage(self, checkpoint_id: str) -> list[Manifest]:
        """The checkpoint and its ancestors, newest first, up to a root or the first ancestor no longer stored."""
        chain = [self.get_manifest(checkpoint_id)]
        seen = {checkpoint_id}
        while chain[-1].parent_id and chain[-1].parent_id not in seen:
            seen.add(chain[-1].parent_id)
            try:
                chain.append(self.get_manifest(chain[-1].parent_id))
            except CheckpointNotFound:
                break
        return chain

    def usage(self) -> dict[str, dict[str, int]]:
        """Objects and bytes stored, per kind (packs, index, manifests, refs, locks, config)."""
        totals: dict[str, dict[str, int]] = {}
        for info in self.backend.list(""):
            kind = info.key.split("/", 1)[0]
            t = totals.setdefault(kind, {"objects": 0, "bytes": 0})
            t["objects"] += 1
            t["bytes"] += info.size
        return totals

    def stored_bytes(self) -> int:
        return sum(t["bytes"] for t in self.usage().values())

    # -- maintenance and portability ---------------------------------------------------------------------------

    def verify(self, checkpoint_id: str | None = None) -> VerifyReport:
        from keepstate.store.verify import verify_checkpoint, verify_repository

        if checkpoint_id is None:
            return verify_repository(self)
        return verify_checkpoint(self, checkpoint_id)

    def gc(self, repack_threshold: float = 0.0) -> GcReport:
        from keepstate.store.gc import collect

        return collect(self, repack_threshold)

    def export_checkpoint(self, checkpoint_id: str, out: IO[bytes], progress: Progress | None = None) -> None:
        from keepstate.store.export import export_checkpoint

        export_checkpoint(self, checkpoint_id, out, progress)

    def import_checkpoint(self, inp: IO[bytes], progress: Progress | None = None) -> Manifest:
        from keepstate.store.export import import_checkpoint

        return import_checkpoint(self, inp, progress)
