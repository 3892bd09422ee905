"""Cutting image files into chunks by their kind (docs/design/checkpoint-format.md, *kind*).

Kind "memory": fixed page-aligned blocks, for an image rewritten in place, whose page overwrites then change only
their own blocks. Kind "file": FastCDC, for content that moves or grows by insertions, which would shift every later
fixed block, so it is cut where its content says. The server stores every file as kind "file", gVisor's memory
image pages.img included: it holds committed pages in allocation order, so pages move between checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pyfastcdc import FastCDC

PAGE_SIZE = 4096
# Large sequential reads for kind "memory"; a multiple of every sane block size.
_READ_SIZE = 16 << 20


@dataclass(frozen=True)
class ChunkerParams:
    memory_block_size: int = 64 * 1024
    # Smaller than the usual 64 KiB average because gVisor memory images are the big files: between two
    # checkpoints the agent and the language runtimes dirty scattered 4 KiB pages, and each costs a whole chunk
    # (measured in benchmarks/checkpoint.py: 32 KiB stores about 25 % less per increment than 64 KiB at the
    # same ingest speed; 16 KiB doubles the manifest and slows ingest for little more).
    file_chunk_min: int = 8 * 1024
    file_chunk_avg: int = 32 * 1024
    file_chunk_max: int = 128 * 1024

    def __post_init__(self) -> None:
        if self.memory_block_size <= 0 or self.memory_block_size % PAGE_SIZE:
            raise ValueError(f"memory_block_size must be a positive multiple of {PAGE_SIZE}")
        if not self.file_chunk_min <= self.file_chunk_avg <= self.file_chunk_max:
            raise ValueError("file chunk sizes must satisfy min <= avg <= max")


def fixed_blocks(path: Path, block_size: int) -> Iterator[memoryview]:
    """Yield `block_size` pieces of the file (the last may be shorter). Each view is valid until the next
    `_READ_SIZE` boundary is read, so consumers must copy or finish with it before asking for many more."""
    read_size = max(block_size, _READ_SIZE - _READ_SIZE % block_size)
    with open(path, "rb", buffering=0) as f:
        while True:
            buf = bytearray(read_size)  # fresh buffer: views handed out earlier stay valid
            n = f.readinto(buf)
            if not n:
                return
            view = memoryview(buf)[:n]
            for start in range(0, n, block_size):
                yield view[start:start + block_size]
            if n < read_size:
                return


def content_defined(path: Path, params: ChunkerParams) -> Iterator[memoryview]:
    """Yield FastCDC chunks of the file. Views point into an mmap of the file that lives as long as they do."""
    if os.path.getsize(path) == 0:
        return  # mmap cannot map an empty file
    cdc = FastCDC(params.file_chunk_avg, min_size=params.file_chunk_min, max_size=params.file_chunk_max)
    for chunk in cdc.cut_file(str(path)):
        yield chunk.data


def chunks_of(path: Path, kind: str, params: ChunkerParams) -> Iterator[memoryview]:
    if kind == "memory":
        return fixed_blocks(path, params.memory_block_size)
    if kind == "file":
        return content_defined(path, params)
    raise ValueError(f"unknown image file kind {kind!r}: expected 'memory' or 'file'")
