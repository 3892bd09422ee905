"""Garbage collection: remove what no ref reaches, in the order of rule D4 of checkpoint-format.md."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from keepstate.store import ids, pack
from keepstate.store import lock as lock_mod
from keepstate.store.errors import CheckpointNotFound, CorruptObject, ObjectNotFound, StoreError
from keepstate.store.ingest import PackWriter
from keepstate.store.lock import Lock

if TYPE_CHECKING:
    from keepstate.store.repository import Repository


class GcAborted(StoreError):
    """gc found something it cannot read, so it cannot know what is live (rule D3); nothing was removed."""


@dataclass
class GcReport:
    live_checkpoints: int = 0
    stale_locks_removed: int = 0
    manifests_removed: int = 0
    index_removed: int = 0
    index_written: int = 0
    packs_removed: int = 0
    packs_repacked: int = 0
    packs_written: int = 0
    chunks_copied: int = 0
    leftover_bytes_removed: int = 0
    bytes_before: int = 0
    bytes_after: int = 0

    @property
    def bytes_freed(self) -> int:
        return self.bytes_before - self.bytes_after

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "bytes_freed": self.bytes_freed}

    def summary(self) -> str:
        return (f"{self.live_checkpoints} live checkpoint(s); removed {self.packs_removed} pack(s), "
                f"{self.index_removed} index object(s), {self.manifests_removed} manifest(s), "
                f"{self.stale_locks_removed} stale lock(s), {self.leftover_bytes_removed} bytes of leftovers; "
                f"repacked {self.packs_repacked} pack(s) into {self.packs_written}; "
                f"freed {self.bytes_freed} of {self.bytes_before} bytes")


def collect(repo: Repository, repack_threshold: float = 0.0) -> GcReport:
    """Reclaim unreferenced objects. A pack whose dead share (by stored bytes) exceeds `repack_threshold` has its
    live chunks copied to new packs; 0 reclaims every dead chunk, 1 only removes packs that are entirely dead."""
    if not 0.0 <= repack_threshold <= 1.0:
        raise ValueError("repack_threshold must be between 0 and 1")
    report = GcReport()
    backend = repo.backend
    report.bytes_before = repo.stored_bytes()
    report.stale_locks_removed = lock_mod.remove_stale(backend)
    with Lock(backend, "exclusive", "gc"):  # D2

        # D3: the live set, or abort.
        live_manifests: set[str] = set()
        live_chunks: set[bytes] = set()
        for checkpoint_id in repo.ref_ids():
            try:
                manifest = repo.load_manifest(repo.manifest_id_of(checkpoint_id))
            except CheckpointNotFound:
                continue
            except (CorruptObject, ObjectNotFound) as exc:
                raise GcAborted(f"gc aborted, nothing removed: checkpoint {checkpoint_id} is unreadable ({exc}); "
                                "run `keepstate store verify`, then delete or repair it") from exc
            live_manifests.add(manifest.id)
            live_chunks |= manifest.chunk_ids()
        report.live_checkpoints = len(live_manifests)
        index, bad = repo.load_index()
        if bad:
            raise GcAborted(f"gc aborted, nothing removed: {bad[0]}; run `keepstate store verify`")
        lost = [c for c in live_chunks if c not in index]
        if lost:
            raise GcAborted(f"gc aborted, nothing removed: live chunk {lost[0].hex()} is in no index "
                            f"({len(lost)} such chunk(s)); run `keepstate store verify`")

        stored_packs = {bytes.fromhex(name): info.size for info in backend.list("packs/")
                        if ids.is_hex_id(name := info.key.rsplit("/", 1)[1])}
        keep: list[bytes] = []
        repack: list[bytes] = []
        for pack_id, record in index.packs.items():
            # A chunk stored twice (two concurrent writers) lives only where the index locates it.
            live_here = [e for e in record.entries
                         if e.chunk_id in live_chunks and index.chunks[e.chunk_id].pack_id == pack_id]
            if pack_id not in stored_packs:
                if live_here:
                    raise GcAborted(f"gc aborted, nothing removed: pack {pack_id.hex()} holding live chunks is "
                                    "missing; run `keepstate store verify`")
                continue
            if not live_here:
                continue
            total = sum(e.stored_len for e in record.entries)
            dead = total - sum(e.stored_len for e in live_here)
            if dead and dead / total > repack_threshold:
                repack.append(pack_id)
            else:
                keep.append(pack_id)

        # D4.1: copy live chunks out of partly dead packs, verifying each first.
        writer = PackWriter(repo.save_pack, repo.config.pack_target_size)
        try:
            for pack_id in repack:
                data = memoryview(backend.load(repo.pack_key(pack_id)))
                for e in index.packs[pack_id].entries:
                    if e.chunk_id not in live_chunks or index.chunks[e.chunk_id].pack_id != pack_id:
                        continue
                    stored = data[e.offset:e.offset + e.stored_len]
                    try:
                        pack.decode_chunk(e, stored)
                    except ValueError as exc:
                        raise GcAborted(f"gc aborted, nothing removed: pack {pack_id.hex()} chunk "
                                        f"{e.chunk_id.hex()}: {exc}") from exc
                    writer.add(e.chunk_id, bytes(stored), e.raw_len, e.compression)
                    report.chunks_copied += 1
            new_records = writer.finish()
        finally:
            writer.close()
        report.packs_repacked = len(repack)
        report.packs_written = len(new_records)

        # D4.2-3: one new index object for everything kept, then remove the ones it supersedes.
        records = [index.packs[p] for p in keep] + new_records
        old_index = set(index.index_ids)
        keep_index: set[str] = set()
        changed = bool(repack) or len(keep) != len(index.packs) or len(old_index) > 1
        if records and changed:
            keep_index = {repo.save_index(records)}
            report.index_written = 1
        elif records:
            keep_index = old_index
        for name in old_index - keep_index:
            backend.remove(f"index/{name}")
            report.index_removed += 1

        # D4.4: packs no remaining index lists.
        listed = set(keep) | {r.pack_id for r in new_records}
        for pack_id in stored_packs:
            if pack_id not in listed:
                backend.remove(repo.pack_key(pack_id))
                report.packs_removed += 1

        # D4.5-6: manifests no ref names, then leftovers of interrupted saves.
        for info in backend.list("manifests/"):
            if info.key.split("/", 1)[1] not in live_manifests:
                backend.remove(info.key)
                report.manifests_removed += 1
        report.leftover_bytes_removed = backend.remove_leftovers()
    report.bytes_after = repo.stored_bytes()
    return report
