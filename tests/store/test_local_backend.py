"""The local backend's direct writes: large objects bypass the page cache; a filesystem that refuses O_DIRECT
gets buffered writes of the same bytes."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest

from keepstate.store import LocalBackend
from keepstate.store.backend import local


def _watch_direct(monkeypatch: pytest.MonkeyPatch, refuse: bool) -> list[int]:
    """Record every attempt to switch a descriptor to O_DIRECT; refuse them as tmpfs on old kernels does."""
    asked: list[int] = []
    real = fcntl.fcntl

    def fake_fcntl(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            asked.append(fd)
            if refuse:
                raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(local.fcntl, "fcntl", fake_fcntl)
    return asked


def test_large_objects_are_written_direct_and_small_ones_buffered(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    asked = _watch_direct(monkeypatch, refuse=False)
    backend = LocalBackend(tmp_path / "store")
    big = os.urandom(local.DIRECT_MIN + 4097)
    backend.save("packs/00/big", big)
    assert len(asked) == 1
    backend.save("refs/small", b"x" * 100)
    assert len(asked) == 1
    assert backend.load("packs/00/big") == big
    assert backend.load("refs/small") == b"x" * 100


def test_a_filesystem_refusing_o_direct_gets_buffered_writes(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    asked = _watch_direct(monkeypatch, refuse=True)
    backend = LocalBackend(tmp_path / "store")
    blobs = [os.urandom(local.DIRECT_MIN + n) for n in (1, 2)]
    backend.save("packs/00/a", blobs[0])
    backend.save("packs/00/b", blobs[1])
    assert len(asked) == 1  # asked once, then remembered
    assert [backend.load("packs/00/a"), backend.load("packs/00/b")] == blobs
    assert backend.remove_leftovers() == 0
