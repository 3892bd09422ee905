"""Packs: many stored chunks back to back, then an entry table describing them (see checkpoint-format.md)."""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

import zstandard

from keepstate.store import ids
from keepstate.store.errors import CorruptObject

MAGIC = b"KSPK"
VERSION = 1
HEADER = MAGIC + bytes([VERSION, 0, 0, 0])
_ENTRY = struct.Struct("<32sIIIB3x")
ENTRY_SIZE = _ENTRY.size  # 48
_TRAILER = struct.Struct("<I4s")

RAW = 0
ZSTD = 1


@dataclass(frozen=True)
class PackEntry:
    """Where one chunk lies in a pack. Also the unit of an index object."""

    chunk_id: bytes
    offset: int
    stored_len: int
    raw_len: int
    compression: int

    def encode(self) -> bytes:
        return _ENTRY.pack(self.chunk_id, self.offset, self.stored_len, self.raw_len, self.compression)

    @classmethod
    def decode(cls, data: bytes | memoryview, at: int = 0) -> PackEntry:
        chunk_id, offset, stored_len, raw_len, compression = _ENTRY.unpack_from(data, at)
        if compression not in (RAW, ZSTD):
            raise ValueError(f"unknown compression {compression}")
        return cls(bytes(chunk_id), offset, stored_len, raw_len, compression)


_local = threading.local()
_SAMPLE = 4096


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """One compressor per thread and level: making a context costs as much as compressing 64 KiB."""
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("zstd", {})
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level)
    return c


def compress(raw: bytes | memoryview, level: int) -> tuple[bytes | memoryview, int]:
    """Return (stored bytes, compression). Raw when zstd saves less than 1/32: restoring raw data is cheaper.
    Raw chunks are handed back as given, not copied (memory bandwidth is what ingest spends most)."""
    compressor = _compressor(level)
    if len(raw) >= 4 * _SAMPLE:
        # Memory images are full of incompressible pages (random data, compressed files, keys): judge a chunk
        # by its first 4 KiB before spending a whole compression on it.
        sample = compressor.compress(raw[:_SAMPLE])
        if len(sample) > _SAMPLE - _SAMPLE // 32:
            return raw, RAW
    packed = compressor.compress(raw)
    if len(packed) > len(raw) - len(raw) // 32:
        return raw, RAW
    return packed, ZSTD


def decode_chunk(entry: PackEntry, stored: bytes | memoryview) -> bytes | memoryview:
    """Decompress and verify one chunk (a raw chunk is handed back as given, not copied). Raises ValueError with
    the reason when it does not match its ID."""
    raw: bytes | memoryview
    if entry.compression == ZSTD:
        try:
            # A damaged frame header can claim any content size, and zstandard allocates what the frame claims:
            # check it against the recorded length before decompressing.
            claimed = zstandard.frame_content_size(stored)
            if claimed != entry.raw_len:
                raise ValueError(f"zstd frame claims {claimed} bytes, not the recorded {entry.raw_len}")
            raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=entry.raw_len)
        except zstandard.ZstdError as exc:
            raise ValueError(f"cannot decompress: {exc}") from exc
    else:
        raw = stored
    if len(raw) != entry.raw_len:
        raise ValueError(f"length {len(raw)} differs from the recorded {entry.raw_len}")
    if ids.digest(raw) != entry.chunk_id:
        raise ValueError("content does not match its chunk ID (BLAKE3)")
    return raw


class PackBuilder:
    """Accumulates stored chunks in memory until the pack is full, then produces its bytes and ID."""

    def __init__(self) -> None:
        self._parts: list[bytes | memoryview] = [HEADER]
        self._size = len(HEADER)
        self.entries: list[PackEntry] = []
        self._ids: set[bytes] = set()

    @property
    def size(self) -> int:
        return self._size + ENTRY_SIZE * len(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, chunk_id: bytes) -> bool:
        return chunk_id in self._ids

    def add(self, chunk_id: bytes, stored: bytes | memoryview, raw_len: int, compression: int) -> None:
        if chunk_id in self._ids:
            return
        self.entries.append(PackEntry(chunk_id, self._size, len(stored), raw_len, compression))
        self._ids.add(chunk_id)
        self._parts.append(stored)
        self._size += len(stored)

    def finish(self) -> tuple[bytes, bytes]:
        """Return (pack ID, pack bytes)."""
        pack_id, parts = self.finish_parts()
        return pack_id, b"".join(parts)

    def finish_parts(self) -> tuple[bytes, list[bytes | memoryview]]:
        """Return (pack ID, the pack's bytes as consecutive parts), hashing without joining them."""
        table = b"".join(e.encode() for e in self.entries)
        parts = [*self._parts, table, _TRAILER.pack(len(self.entries), MAGIC)]
        return ids.digest_parts(parts), parts


def parse(pack_name: str, data: bytes) -> list[PackEntry]:
    """Parse a whole pack's entry table, checking its structure (not the chunks: see decode_chunk)."""
    try:
        if len(data) < len(HEADER) + _TRAILER.size or data[:4] != MAGIC:
            raise ValueError("not a pack (bad magic or too short)")
        if data[4] != VERSION:
            raise ValueError(f"unsupported pack version {data[4]}")
        count, magic = _TRAILER.unpack_from(data, len(data) - _TRAILER.size)
        if magic != MAGIC:
            raise ValueError("bad trailer magic")
        table_at = len(data) - _TRAILER.size - count * ENTRY_SIZE
        if table_at < len(HEADER):
            raise ValueError(f"entry count {count} does not fit the pack")
        entries = [PackEntry.decode(data, table_at + i * ENTRY_SIZE) for i in range(count)]
        for e in entries:
            if e.offset < len(HEADER) or e.offset + e.stored_len > table_at:
                raise ValueError(f"entry for chunk {e.chunk_id.hex()} points outside the chunk records")
        return entries
    except (ValueError, struct.error) as exc:
        raise CorruptObject("pack", pack_name, str(exc)) from exc
