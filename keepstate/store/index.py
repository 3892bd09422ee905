"""The index: which pack holds each chunk. Stored as immutable per-writer index objects; held merged in memory."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from keepstate.store import ids
from keepstate.store.errors import CorruptObject
from keepstate.store.pack import ENTRY_SIZE, PackEntry

MAGIC = b"KSIX"
VERSION = 1
_HEAD = struct.Struct("<4sB3xI")
_PACK = struct.Struct("<32sQI")


@dataclass(frozen=True)
class PackRecord:
    pack_id: bytes
    pack_len: int
    entries: tuple[PackEntry, ...]


@dataclass(frozen=True)
class Location:
    pack_id: bytes
    entry: PackEntry


def encode(packs: Iterable[PackRecord]) -> tuple[bytes, bytes]:
    """Return (index ID, index object bytes)."""
    packs = list(packs)
    parts = [_HEAD.pack(MAGIC, VERSION, len(packs))]
    for p in packs:
        parts.append(_PACK.pack(p.pack_id, p.pack_len, len(p.entries)))
        parts.extend(e.encode() for e in p.entries)
    data = b"".join(parts)
    return ids.digest(data), data


def decode(name: str, data: bytes) -> list[PackRecord]:
    """Verify an index object against its storage ID `name` and parse it."""
    if ids.hexdigest(data) != name:
        raise CorruptObject("index", name, "content does not match its storage ID (BLAKE3)")
    try:
        magic, version, count = _HEAD.unpack_from(data, 0)
        if magic != MAGIC:
            raise ValueError("not an index object (bad magic)")
        if version != VERSION:
            raise ValueError(f"unsupported index version {version}")
        at = _HEAD.size
        packs = []
        for _ in range(count):
            pack_id, pack_len, n = _PACK.unpack_from(data, at)
            at += _PACK.size
            entries = tuple(PackEntry.decode(data, at + i * ENTRY_SIZE) for i in range(n))
            at += n * ENTRY_SIZE
            packs.append(PackRecord(bytes(pack_id), pack_len, entries))
        if at != len(data):
            raise ValueError(f"{len(data) - at} trailing bytes")
        return packs
    except (ValueError, struct.error) as exc:
        raise CorruptObject("index", name, str(exc)) from exc


@dataclass
class Index:
    """The merged, in-memory view of index objects. The first location recorded for a chunk wins."""

    chunks: dict[bytes, Location] = field(default_factory=dict)
    packs: dict[bytes, PackRecord] = field(default_factory=dict)
    # Which index objects list each pack; gc needs it to know what to supersede.
    pack_sources: dict[bytes, set[str]] = field(default_factory=dict)
    index_ids: set[str] = field(default_factory=set)

    def add(self, index_id: str, records: Iterable[PackRecord]) -> None:
        self.index_ids.add(index_id)
        for record in records:
            self.pack_sources.setdefault(record.pack_id, set()).add(index_id)
            if record.pack_id in self.packs:
                continue
            self.packs[record.pack_id] = record
            for entry in record.entries:
                self.chunks.setdefault(entry.chunk_id, Location(record.pack_id, entry))

    def __contains__(self, chunk_id: bytes) -> bool:
        return chunk_id in self.chunks

    def get(self, chunk_id: bytes) -> Location | None:
        return self.chunks.get(chunk_id)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.chunks)
