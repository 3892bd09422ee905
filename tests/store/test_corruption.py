"""Flipping one byte of a stored object makes restore fail, naming checkpoint and object, and verify find it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from keepstate.store import Backend, CheckpointMeta, CorruptCheckpoint, ImageFile, RepoConfig, Repository
from keepstate.store import pack as pack_mod
from keepstate.store.verify import format_report
from tests.store.conftest import MiB, write_memory_image, write_text_file


def flip(backend: Backend, key: str, position: int) -> None:
    data = bytearray(backend.load(key))
    data[position % len(data)] ^= 0x01
    backend.save(key, bytes(data))


def make_checkpoint(backend: Backend, tmp_path: Path) -> tuple[Repository, str]:
    src = tmp_path / "src"
    src.mkdir()
    write_memory_image(src / "pages.img", 4 * MiB, seed=21, random_share=0.3)
    write_text_file(src / "rootfs" / "a.txt", 700_000, seed=22)
    # Small packs, so the checkpoint spans several.
    repo = Repository.init(backend, config=RepoConfig(pack_target_size=MiB))
    m = repo.write_checkpoint([ImageFile("pages.img", src / "pages.img", "memory"),
                               ImageFile("rootfs/a.txt", src / "rootfs" / "a.txt", "file")],
                              CheckpointMeta(session_id="s"))
    return repo, m.checkpoint_id


def object_to_damage(repo: Repository, checkpoint_id: str, kind: str, rnd: random.Random) -> tuple[str, str, int]:
    """(key, object name, byte position) of a `kind` object the checkpoint uses, and a byte in it that restore
    must read: for packs, a byte inside a stored chunk."""
    if kind == "ref":
        key = f"refs/{checkpoint_id}"
        return key, checkpoint_id, rnd.randrange(repo.backend.stat(key))
    if kind in ("manifest", "index"):
        key = sorted(i.key for i in repo.backend.list("manifests/" if kind == "manifest" else "index/"))[0]
        return key, key.split("/")[1], rnd.randrange(repo.backend.stat(key))
    key = rnd.choice(sorted(i.key for i in repo.backend.list("packs/")))
    entry = rnd.choice(pack_mod.parse(key, repo.backend.load(key)))
    return key, key.rsplit("/", 1)[1], entry.offset + rnd.randrange(entry.stored_len)


def assert_nothing_restored(dest: Path) -> None:
    assert not dest.exists()
    if dest.parent.exists():  # failures found before any byte is written do not even create it
        assert [p.name for p in dest.parent.iterdir()
                if p.name.startswith(f".{dest.name}")] == []


@pytest.mark.parametrize("kind", ["pack", "index", "manifest", "ref"])
def test_flipped_byte_is_detected(backend: Backend, tmp_path: Path, kind: str) -> None:
    repo, checkpoint_id = make_checkpoint(backend, tmp_path)
    key, name, position = object_to_damage(repo, checkpoint_id, kind, random.Random(kind))
    flip(backend, key, position)

    dest = tmp_path / "restore" / "out"
    with pytest.raises(CorruptCheckpoint) as info:
        repo.read_checkpoint(checkpoint_id, dest)
    assert info.value.checkpoint_id == checkpoint_id
    assert info.value.kind == kind
    assert checkpoint_id in str(info.value) and name in str(info.value)
    assert_nothing_restored(dest)

    report = repo.verify()
    assert not report.ok
    assert any(p.kind == kind and p.name == name for p in report.problems), format_report(report)
    assert not repo.verify(checkpoint_id).ok


@pytest.mark.parametrize("seed", range(6))
def test_any_byte_of_any_used_object(tmp_path: Path, seed: int) -> None:
    from keepstate.store import LocalBackend

    rnd = random.Random(seed)
    backend = LocalBackend(tmp_path / "store")
    repo, checkpoint_id = make_checkpoint(backend, tmp_path)
    kind = ["pack", "index", "manifest", "ref"][seed % 4]
    key, name, position = object_to_damage(repo, checkpoint_id, kind, rnd)
    flip(backend, key, position)
    with pytest.raises(CorruptCheckpoint) as info:
        repo.read_checkpoint(checkpoint_id, tmp_path / "out")
    assert (info.value.kind, info.value.checkpoint_id) == (kind, checkpoint_id)
    assert_nothing_restored(tmp_path / "out")


def test_verify_finds_damage_restore_does_not_read(tmp_path: Path) -> None:
    """A flipped byte in a pack's entry table is not used by restore, but verify still finds it."""
    from keepstate.store import LocalBackend

    backend = LocalBackend(tmp_path / "store")
    repo, checkpoint_id = make_checkpoint(backend, tmp_path)
    key = sorted(i.key for i in backend.list("packs/"))[0]
    flip(backend, key, backend.stat(key) - 20)
    report = repo.verify()
    assert [p.kind for p in report.problems] == ["pack"] * len(report.problems) and report.problems
    assert checkpoint_id in report.problems[0].checkpoints


def test_missing_pack_is_named(tmp_path: Path) -> None:
    from keepstate.store import LocalBackend

    backend = LocalBackend(tmp_path / "store")
    repo, checkpoint_id = make_checkpoint(backend, tmp_path)
    key = sorted(i.key for i in backend.list("packs/"))[0]
    backend.remove(key)
    with pytest.raises(CorruptCheckpoint, match="missing") as info:
        repo.read_checkpoint(checkpoint_id, tmp_path / "out")
    assert info.value.kind == "pack" and info.value.name == key.rsplit("/", 1)[1]
    assert_nothing_restored(tmp_path / "out")
    assert any(p.kind == "pack" and "missing" in p.message for p in repo.verify().problems)


def test_truncated_pack_is_named(tmp_path: Path) -> None:
    from keepstate.store import LocalBackend

    backend = LocalBackend(tmp_path / "store")
    repo, checkpoint_id = make_checkpoint(backend, tmp_path)
    key = sorted(i.key for i in backend.list("packs/"))[0]
    backend.save(key, backend.load(key)[: backend.stat(key) // 3])
    with pytest.raises(CorruptCheckpoint) as info:
        repo.read_checkpoint(checkpoint_id, tmp_path / "out")
    assert info.value.kind == "pack"
    assert_nothing_restored(tmp_path / "out")
