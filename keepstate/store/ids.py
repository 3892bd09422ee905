"""Hashes and identifiers: chunk and storage IDs (BLAKE3-256) and checkpoint IDs (ULIDs)."""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Iterable

import blake3

ID_SIZE = 32
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_CHECKPOINT_ID = re.compile(r"^[0-9A-Za-z_-]{1,128}$")
_HEX_ID = re.compile(r"^[0-9a-f]{64}$")


def digest(data: bytes | bytearray | memoryview) -> bytes:
    """BLAKE3-256 of `data`: a chunk ID (of raw bytes) or a storage ID (of stored bytes)."""
    return blake3.blake3(data).digest()


def digest_parts(parts: Iterable[bytes | bytearray | memoryview]) -> bytes:
    """digest() of the parts' concatenation, without joining them."""
    hasher = blake3.blake3()
    for part in parts:
        hasher.update(part)
    return hasher.digest()


def hexdigest(data: bytes | bytearray | memoryview) -> str:
    return blake3.blake3(data).hexdigest()


@functools.lru_cache(maxsize=16)
def zero_chunk_id(length: int) -> bytes:
    """ID of a chunk of `length` zero bytes; memory images hold many, and a restore leaves them as holes."""
    return digest(bytes(length))


def new_checkpoint_id() -> str:
    """A ULID: 48 bits of milliseconds then 80 random bits, so IDs sort by creation time."""
    value = (int(time.time() * 1000) << 80) | int.from_bytes(os.urandom(10), "big")
    return "".join(_CROCKFORD[(value >> shift) & 31] for shift in range(125, -1, -5))


def check_checkpoint_id(checkpoint_id: str) -> str:
    if not _CHECKPOINT_ID.match(checkpoint_id):
        raise ValueError(f"invalid checkpoint ID {checkpoint_id!r}: use 1-128 characters of [0-9A-Za-z_-]")
    return checkpoint_id


def is_hex_id(name: str) -> bool:
    return bool(_HEX_ID.match(name))
