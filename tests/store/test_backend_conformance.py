"""The backend contract (keepstate/store/backend/__init__.py), checked against every backend on a real server."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from keepstate.store import Backend, ObjectNotFound, ShortRead
from tests.store.conftest import SECRET_KEY


def test_save_then_load_returns_the_same_bytes(backend: Backend) -> None:
    data = os.urandom(300_000)
    backend.save("packs/ab/object", data)
    assert backend.load("packs/ab/object") == data
    assert backend.stat("packs/ab/object") == len(data)


def test_large_object_in_parts_round_trips(backend: Backend) -> None:
    # Packs are given in parts; the local backend writes them with O_DIRECT in 4 MiB blocks: parts straddle the
    # blocks and the tail is not a multiple of any block size.
    parts = [os.urandom(n) for n in (1, 3 << 20, 4095, (5 << 20) + 7, 123_457)]
    backend.save_parts("packs/cd/large", parts)
    assert backend.load("packs/cd/large") == b"".join(parts)
    assert backend.stat("packs/cd/large") == sum(map(len, parts))
    assert backend.load("packs/cd/large", 3 << 20, 10) == parts[1][-1:] + parts[2][:9]
    assert backend.remove_leftovers() == 0


def test_load_of_a_range(backend: Backend) -> None:
    backend.save("index/x", bytes(range(256)) * 4)
    assert backend.load("index/x", 10, 5) == bytes([10, 11, 12, 13, 14])
    assert backend.load("index/x", 1000) == bytes(range(232, 256))
    assert backend.load("index/x", 0, 0) == b""


def test_range_past_the_end_is_a_short_read(backend: Backend) -> None:
    backend.save("index/short", b"0123456789")
    with pytest.raises(ShortRead):
        backend.load("index/short", 5, 10)


def test_missing_objects_raise_object_not_found(backend: Backend) -> None:
    with pytest.raises(ObjectNotFound):
        backend.load("refs/none")
    with pytest.raises(ObjectNotFound):
        backend.load("refs/none", 0, 4)
    with pytest.raises(ObjectNotFound):
        backend.stat("refs/none")
    assert not backend.exists("refs/none")


def test_save_replaces_an_existing_object(backend: Backend) -> None:
    backend.save("refs/a", b"first")
    backend.save("refs/a", b"second, longer")
    assert backend.load("refs/a") == b"second, longer"


def test_empty_object(backend: Backend) -> None:
    backend.save("locks/empty", b"")
    assert backend.load("locks/empty") == b""
    assert backend.stat("locks/empty") == 0


def test_list_by_prefix_is_recursive_and_exact(backend: Backend) -> None:
    for key in ("packs/00/a", "packs/01/b", "index/c", "refs/d", "refs2/e"):
        backend.save(key, key.encode())
    assert {(i.key, i.size) for i in backend.list("packs/")} == {("packs/00/a", 10), ("packs/01/b", 10)}
    assert {i.key for i in backend.list("refs/")} == {"refs/d"}
    assert {i.key for i in backend.list("")} == {"packs/00/a", "packs/01/b", "index/c", "refs/d", "refs2/e"}
    assert list(backend.list("nothing/")) == []


def test_remove_is_idempotent(backend: Backend) -> None:
    backend.save("manifests/m", b"x")
    backend.remove("manifests/m")
    backend.remove("manifests/m")
    assert not backend.exists("manifests/m")
    assert list(backend.list("manifests/")) == []


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "./a"])
def test_bad_keys_are_refused(backend: Backend, key: str) -> None:
    with pytest.raises(ValueError):
        backend.save(key, b"x")


def test_concurrent_saves_and_loads_from_threads(backend: Backend) -> None:
    blobs = {f"packs/{i:02x}/obj{i}": os.urandom(50_000 + i) for i in range(24)}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: backend.save(*kv), blobs.items()))
        loaded = dict(zip(blobs, pool.map(backend.load, blobs), strict=True))
    assert loaded == blobs
    assert backend.remove_leftovers() == 0


def test_location_names_no_secret(backend: Backend) -> None:
    assert SECRET_KEY not in backend.location
