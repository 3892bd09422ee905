from __future__ import annotations

import pytest

from keepstate.store import CorruptObject, ids, index
from keepstate.store.pack import PackEntry


def record(n: int, seed: bytes) -> index.PackRecord:
    entries = tuple(PackEntry(ids.digest(seed + bytes([i])), 8 + 100 * i, 100, 400, 1) for i in range(n))
    return index.PackRecord(ids.digest(seed), 8 + 100 * n + 48 * n + 8, entries)


def test_encode_decode_round_trip() -> None:
    records = [record(3, b"a"), record(0, b"b"), record(5, b"c")]
    index_id, data = index.encode(records)
    assert index.decode(index_id.hex(), data) == records


def test_any_flipped_byte_is_caught() -> None:
    index_id, data = index.encode([record(2, b"a")])
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0x80
        with pytest.raises(CorruptObject):
            index.decode(index_id.hex(), bytes(damaged))


def test_merged_index_keeps_the_first_location() -> None:
    a, b = record(2, b"a"), record(2, b"a")
    b = index.PackRecord(ids.digest(b"other pack"), b.pack_len, b.entries)
    merged = index.Index()
    merged.add("i1", [a])
    merged.add("i2", [b])
    chunk = a.entries[0].chunk_id
    assert chunk in merged and merged.get(chunk).pack_id == a.pack_id  # type: ignore[union-attr]
    assert set(merged.packs) == {a.pack_id, b.pack_id} and merged.index_ids == {"i1", "i2"}
