"""Garbage collection: what it reclaims, what it keeps, and when it refuses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from keepstate.store import (
    CheckpointMeta,
    GcAborted,
    ImageFile,
    LocalBackend,
    RepoConfig,
    Repository,
    RepositoryLocked,
)
from keepstate.store.lock import Lock
from tests.store.conftest import MiB, write_memory_image


def two_checkpoints(tmp_path: Path, backend: LocalBackend) -> tuple[Repository, list[str], list[Path]]:
    repo = Repository.init(backend, config=RepoConfig(pack_target_size=2 * MiB))
    ids, images = [], []
    for i in range(2):
        img = tmp_path / f"img{i}"
        write_memory_image(img, 4 * MiB, seed=40 + i, random_share=0.7)
        ids.append(repo.write_checkpoint([ImageFile("pages.img", img, "memory")],
                                         CheckpointMeta(session_id="s")).checkpoint_id)
        images.append(img)
    return repo, ids, images


def test_gc_reclaims_a_deleted_checkpoint(tmp_path: Path) -> None:
    local = LocalBackend(tmp_path / "store")
    repo, ids, images = two_checkpoints(tmp_path, local)
    full = repo.stored_bytes()
    repo.delete_checkpoint(ids[0])
    report = repo.gc()
    assert report.manifests_removed == 1 and report.packs_removed >= 1
    assert repo.stored_bytes() < 0.6 * full
    assert repo.gc().bytes_freed == 0  # nothing left to do
    repo.read_checkpoint(ids[1], tmp_path / "out")
    assert (tmp_path / "out" / "pages.img").read_bytes() == images[1].read_bytes()
    assert repo.verify().ok


def test_repack_keeps_shared_chunks_and_drops_dead_ones(tmp_path: Path) -> None:
    repo = Repository.init(LocalBackend(tmp_path / "store"), config=RepoConfig(pack_target_size=64 * MiB))
    img = tmp_path / "img"
    write_memory_image(img, 4 * MiB, seed=50, random_share=0.9)
    first = repo.write_checkpoint([ImageFile("pages.img", img, "memory")], CheckpointMeta(session_id="s"))
    with open(img, "r+b") as f:
        f.write(os.urandom(2 * MiB))  # half the image changes: the first pack becomes half dead after deletion
    second = repo.write_checkpoint([ImageFile("pages.img", img, "memory")], CheckpointMeta(session_id="s"))
    repo.delete_checkpoint(first.checkpoint_id)

    lenient = repo.gc(repack_threshold=1.0)  # only wholly dead packs go: none here
    assert lenient.packs_removed == 0 and lenient.packs_repacked == 0
    strict = repo.gc()
    assert strict.packs_repacked == 1 and strict.chunks_copied > 0 and strict.bytes_freed > MiB
    assert len(list(repo.backend.list("index/"))) == 1
    repo.read_checkpoint(second.checkpoint_id, tmp_path / "out")
    assert (tmp_path / "out" / "pages.img").read_bytes() == img.read_bytes()
    assert repo.verify().ok


def test_gc_waits_for_writers(tmp_path: Path) -> None:
    repo, _ids, _ = two_checkpoints(tmp_path, LocalBackend(tmp_path / "store"))
    with Lock(repo.backend, "shared", "a writer in this (live) process"):
        with pytest.raises(RepositoryLocked, match="shared lock"):
            repo.gc()
    with Lock(repo.backend, "exclusive", "another gc"):
        with pytest.raises(RepositoryLocked):
            repo.write_checkpoint([ImageFile("x", tmp_path / "img0")], CheckpointMeta(session_id="s"))
    repo.gc()
    assert list(repo.backend.list("locks/")) == []


def test_gc_aborts_without_removing_anything_when_a_manifest_is_unreadable(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "store")
    repo, ids, _ = two_checkpoints(tmp_path, backend)
    repo.delete_checkpoint(ids[0])
    key = f"manifests/{repo.manifest_id_of(ids[1])}"
    data = bytearray(backend.load(key))
    data[-1] ^= 0xFF
    backend.save(key, bytes(data))
    before = {i.key for i in backend.list("")}
    with pytest.raises(GcAborted, match=ids[1]):
        repo.gc()
    assert {i.key for i in backend.list("")} == before
