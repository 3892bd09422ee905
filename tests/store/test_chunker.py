from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from keepstate.store.chunker import ChunkerParams, chunks_of

P = ChunkerParams()


def test_memory_images_are_cut_in_fixed_blocks(tmp_path: Path) -> None:
    path = tmp_path / "m"
    path.write_bytes(os.urandom(3 * P.memory_block_size + 4096))
    sizes = [len(c) for c in chunks_of(path, "memory", P)]
    assert sizes == [P.memory_block_size] * 3 + [4096]
    assert b"".join(bytes(c) for c in chunks_of(path, "memory", P)) == path.read_bytes()


def test_files_are_cut_by_content_so_an_insertion_moves_few_chunks(tmp_path: Path) -> None:
    data = random.Random(1).randbytes(4 << 20)
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(data)
    b.write_bytes(data[:1000] + b"inserted" + data[1000:])
    chunks_a = {bytes(c) for c in chunks_of(a, "file", P)}
    chunks_b = [bytes(c) for c in chunks_of(b, "file", P)]
    assert b"".join(chunks_b) == b.read_bytes()
    assert all(P.file_chunk_min <= len(c) <= P.file_chunk_max for c in chunks_b[:-1])
    assert sum(1 for c in chunks_b if c not in chunks_a) <= 2


def test_empty_files_and_bad_kinds(tmp_path: Path) -> None:
    empty = tmp_path / "e"
    empty.write_bytes(b"")
    assert list(chunks_of(empty, "file", P)) == [] and list(chunks_of(empty, "memory", P)) == []
    with pytest.raises(ValueError):
        chunks_of(empty, "disk", P)
    with pytest.raises(ValueError):
        ChunkerParams(memory_block_size=5000)
