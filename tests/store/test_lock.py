from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from keepstate.store import LocalBackend, RepositoryLocked
from keepstate.store.lock import Lock, read_locks, remove_stale


def test_shared_locks_coexist_and_exclusive_ones_do_not(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    with Lock(backend, "shared", "a"), Lock(backend, "shared", "b"):
        assert len(read_locks(backend)) == 2
        with pytest.raises(RepositoryLocked):
            Lock(backend, "exclusive", "gc").acquire()
    with Lock(backend, "exclusive", "gc"):
        with pytest.raises(RepositoryLocked):
            Lock(backend, "shared", "writer").acquire()
    assert read_locks(backend) == []


def test_stale_locks(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    dead = {"kind": "exclusive", "host": socket.gethostname(), "pid": 2**22 + 12345, "created": time.time(),
            "purpose": "killed"}
    old = {"kind": "exclusive", "host": "elsewhere", "pid": 1, "created": time.time() - 3600, "purpose": "old"}
    live = {"kind": "shared", "host": "elsewhere", "pid": 1, "created": time.time(), "purpose": "live"}
    for name, body in (("dead", dead), ("old", old), ("live", live)):
        backend.save(f"locks/{name}", json.dumps(body).encode())
    with Lock(backend, "shared", "writer"):  # stale exclusive locks do not block
        pass
    assert remove_stale(backend) == 2
    assert [lock.purpose for lock in read_locks(backend)] == ["live"]
