from __future__ import annotations

import os

import pytest

from keepstate.store import CorruptObject, ids, pack


def build(chunks: list[bytes]) -> tuple[bytes, bytes]:
    builder = pack.PackBuilder()
    for raw in chunks:
        stored, compression = pack.compress(raw, 1)
        builder.add(ids.digest(raw), stored, len(raw), compression)
    return builder.finish()


def test_round_trip_and_compression_choice() -> None:
    chunks = [os.urandom(5000), b"a" * 65536, b"", b"text " * 999]
    pack_id, data = build(chunks)
    assert pack_id == ids.digest(data)
    entries = pack.parse(pack_id.hex(), data)
    assert [e.compression for e in entries] == [pack.RAW, pack.ZSTD, pack.RAW, pack.ZSTD]
    for entry, raw in zip(entries, chunks, strict=True):
        assert pack.decode_chunk(entry, data[entry.offset:entry.offset + entry.stored_len]) == raw


def test_duplicate_chunks_are_stored_once() -> None:
    builder = pack.PackBuilder()
    for _ in range(3):
        builder.add(ids.digest(b"x"), b"x", 1, pack.RAW)
    assert len(builder) == 1


def test_decode_chunk_never_returns_wrong_bytes() -> None:
    """Any flipped bit either fails verification or (in bits zstd ignores) still decodes to the right content."""
    raw = b"memory page " * 400
    pack_id, data = build([raw, os.urandom(300)])
    for entry, original in zip(pack.parse(pack_id.hex(), data), [raw, None], strict=True):
        stored = data[entry.offset:entry.offset + entry.stored_len]
        failures = 0
        for i in range(len(stored)):
            for bit in (0x01, 0x10, 0x80):
                damaged = bytearray(stored)
                damaged[i] ^= bit
                try:
                    assert pack.decode_chunk(entry, bytes(damaged)) == (original or stored)
                except ValueError:
                    failures += 1
        assert failures >= len(stored) * 3 - 3


@pytest.mark.parametrize("damage", ["magic", "trailer", "count", "short"])
def test_structural_damage_is_reported(damage: str) -> None:
    pack_id, data = build([os.urandom(100), os.urandom(200)])
    buf = bytearray(data)
    if damage == "magic":
        buf[0] ^= 1
    elif damage == "trailer":
        buf[-1] ^= 1
    elif damage == "count":
        buf[-8] = 200
    else:
        buf = buf[:6]
    with pytest.raises(CorruptObject) as info:
        pack.parse("p", bytes(buf))
    assert info.value.kind == "pack"
