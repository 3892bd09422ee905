"""Archives: one checkpoint in one portable, self-verifying file (layout in checkpoint-format.md)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import IO, TYPE_CHECKING

import blake3

from keepstate.store import ids, pack
from keepstate.store import manifest as manifest_mod
from keepstate.store.errors import ArchiveError, CheckpointExists, CheckpointNotFound, CorruptObject
from keepstate.store.ingest import PackWriter
from keepstate.store.lock import Lock
from keepstate.store.manifest import Manifest
from keepstate.store.restore import fetch_verified, plan

if TYPE_CHECKING:
    from keepstate.store.repository import Repository

MAGIC = b"KSEXPORT"
VERSION = 1
_HEAD = MAGIC + bytes([VERSION]) + bytes(7)
_RECORD = struct.Struct("<BQ32s")
HEADER, MANIFEST, PACK, END = 1, 2, 3, 255
# Refuse absurd record lengths before allocating: packs are ~16 MiB, manifests far smaller.
_MAX_RECORD = 1 << 30

# progress(advance, total): `advance` more stored chunk bytes done out of `total`.
Progress = Callable[[int, int], None]


class _HashingWriter:
    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.hasher = blake3.blake3()

    def write(self, data: bytes) -> None:
        self.hasher.update(data)
        self.out.write(data)

    def record(self, kind: int, object_id: bytes, data: bytes) -> None:
        self.write(_RECORD.pack(kind, len(data), object_id))
        self.write(data)


def export_checkpoint(repo: Repository, checkpoint_id: str, out: IO[bytes], progress: Progress | None) -> None:
    """Write an archive of one checkpoint: its manifest and every chunk it lists, each verified on the way out."""
    manifest = repo.get_manifest(checkpoint_id)
    manifest_bytes = repo.backend.load(f"manifests/{manifest.id}")
    with Lock(repo.backend, "shared", f"export checkpoint {checkpoint_id}"):
        index, bad = repo.load_index()
        plans = plan(checkpoint_id, manifest, index, bad)
        stored_bytes = sum(e.stored_len for p in plans.values() for e, _ in p.chunks.values())
        header = json.dumps({"format": VERSION, "checkpoint_id": checkpoint_id, "manifest_id": manifest.id,
                             "chunks": sum(len(p.chunks) for p in plans.values()), "stored_bytes": stored_bytes,
                             "size": manifest.size}).encode()
        w = _HashingWriter(out)
        w.write(_HEAD)
        w.record(HEADER, ids.digest(header), header)
        w.record(MANIFEST, bytes.fromhex(manifest.id), manifest_bytes)
        # Repack only this checkpoint's chunks: no other checkpoint's data leaks into the archive.
        writer = PackWriter(lambda pack_id, parts: w.record(PACK, pack_id, b"".join(parts)),
                            repo.config.pack_target_size, background=False)
        for p in plans.values():
            for start, length, entries in p.spans(repo.backend.read_span):
                for entry, stored, _raw in fetch_verified(repo, checkpoint_id, p.pack_id, start, length, entries):
                    writer.add(entry.chunk_id, bytes(stored), entry.raw_len, entry.compression)
                    if progress is not None:
                        progress(entry.stored_len, stored_bytes)
        writer.finish()
        digest = w.hasher.digest()
        w.record(END, bytes(32), digest)


class _HashingReader:
    def __init__(self, inp: IO[bytes]) -> None:
        self.inp = inp
        self.hasher = blake3.blake3()

    def read(self, n: int) -> bytes:
        parts = []
        remaining = n
        while remaining:
            data = self.inp.read(remaining)
            if not data:
                raise ArchiveError(f"archive is truncated (wanted {n} more bytes)")
            parts.append(data)
            remaining -= len(data)
        data = b"".join(parts)
        self.hasher.update(data)
        return data

    def record(self) -> tuple[int, bytes, bytes, bytes]:
        """Return (kind, object id, data, archive hash before this record)."""
        before = self.hasher.digest()
        kind, length, object_id = _RECORD.unpack(self.read(_RECORD.size))
        if length > _MAX_RECORD:
            raise ArchiveError(f"archive record of {length} bytes is larger than any valid record")
        return kind, object_id, self.read(length), before


def read_header(inp: IO[bytes]) -> dict[str, object]:
    """Read an archive's header record (for display, before importing)."""
    r = _HashingReader(inp)
    if r.read(len(_HEAD))[:9] != _HEAD[:9]:
        raise ArchiveError("not a KeepState checkpoint archive (bad magic or unknown version)")
    kind, object_id, data, _ = r.record()
    if kind != HEADER or ids.digest(data) != object_id:
        raise ArchiveError("archive header record is damaged")
    result: dict[str, object] = json.loads(data)
    return result


def import_checkpoint(repo: Repository, inp: IO[bytes], progress: Progress | None) -> Manifest:
    """Store an archive's checkpoint in this repository, verifying every record and chunk, then publish it.

    Nothing is published unless the whole archive verified (W1-W4 apply as for any write)."""
    r = _HashingReader(inp)
    head = r.read(len(_HEAD))
    if head[:8] != MAGIC:
        raise ArchiveError("not a KeepState checkpoint archive (bad magic)")
    if head[8] != VERSION:
        raise ArchiveError(f"unsupported archive version {head[8]}; this KeepState reads version {VERSION}")
    kind, object_id, data, _ = r.record()
    if kind != HEADER or ids.digest(data) != object_id:
        raise ArchiveError("archive header record is damaged")
    header = json.loads(data)
    kind, object_id, manifest_bytes, _ = r.record()
    if kind != MANIFEST:
        raise ArchiveError(f"expected the manifest record, found kind {kind}")
    try:
        manifest = manifest_mod.decode(object_id.hex(), manifest_bytes)
    except CorruptObject as exc:
        raise ArchiveError(f"archive's manifest is damaged: {exc}") from exc
    checkpoint_id = manifest.checkpoint_id
    if header.get("checkpoint_id") != checkpoint_id or header.get("manifest_id") != manifest.id:
        raise ArchiveError("archive header and manifest disagree")
    try:
        if repo.manifest_id_of(checkpoint_id) == manifest.id:
            _drain(r)
            return repo.get_manifest(checkpoint_id)
        raise CheckpointExists(f"checkpoint {checkpoint_id} already exists in {repo.backend.location} "
                               "with different content")
    except CheckpointNotFound:
        pass

    with Lock(repo.backend, "shared", f"import checkpoint {checkpoint_id}") as lock:
        index, _bad = repo.load_index()
        writer = PackWriter(repo.save_pack, repo.config.pack_target_size, on_pack=lock.refresh)
        have: set[bytes] = set()
        try:
            while True:
                kind, object_id, data, before = r.record()
                if kind == END:
                    if data != before:
                        raise ArchiveError("archive checksum does not match: the file is damaged")
                    break
                if kind != PACK:
                    raise ArchiveError(f"unexpected archive record kind {kind}")
                if ids.digest(data) != object_id:
                    raise ArchiveError(f"archive pack {object_id.hex()} is damaged (BLAKE3 mismatch)")
                view = memoryview(data)
                try:
                    entries = pack.parse(object_id.hex(), data)
                except CorruptObject as exc:
                    raise ArchiveError(f"archive {exc}") from exc
                for entry in entries:
                    stored = view[entry.offset:entry.offset + entry.stored_len]
                    try:
                        pack.decode_chunk(entry, stored)
                    except ValueError as exc:
                        raise ArchiveError(f"archive pack {object_id.hex()} chunk {entry.chunk_id.hex()}: "
                                           f"{exc}") from exc
                    have.add(entry.chunk_id)
                    if progress is not None:
                        progress(entry.stored_len, int(header.get("stored_bytes", 0)))
                    if entry.chunk_id not in index:
                        writer.add(entry.chunk_id, bytes(stored), entry.raw_len, entry.compression)
            missing = [c for c in manifest.chunk_ids() if c not in have and c not in index]
            if missing:
                raise ArchiveError(f"archive lacks chunk {missing[0].hex()} ({len(missing)} missing)")
            records = writer.finish()
        finally:
            writer.close()
        if records:
            repo.save_index(records)
        repo.backend.save(f"manifests/{manifest.id}", manifest_bytes)
        repo.backend.save(f"refs/{checkpoint_id}", manifest_mod.encode_ref(checkpoint_id, manifest.id))
    return manifest


def _drain(r: _HashingReader) -> None:
    """Read the rest of an archive whose checkpoint is already stored, still checking it is intact."""
    while True:
        kind, _object_id, data, before = r.record()
        if kind == END:
            if data != before:
                raise ArchiveError("archive checksum does not match: the file is damaged")
            return
