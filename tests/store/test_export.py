"""Archives: export one checkpoint, import it into another, empty repository on another backend, restore it."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest

from keepstate.store import ArchiveError, CheckpointMeta, ImageFile, LocalBackend, RepoConfig, Repository
from tests.store.conftest import MiB, S3Server, overwrite, same_tree, write_memory_image, write_text_file


def build_source(tmp_path: Path, repo: Repository) -> tuple[Path, str, str]:
    """Two checkpoints in a lineage; the second shares most chunks with the first."""
    src = tmp_path / "src"
    src.mkdir()
    write_memory_image(src / "pages.img", 8 * MiB, seed=60)
    write_text_file(src / "rootfs" / "notes.txt", 400_000, seed=61)
    files = [ImageFile("pages.img", src / "pages.img", "memory"),
             ImageFile("rootfs/notes.txt", src / "rootfs" / "notes.txt")]
    parent = repo.write_checkpoint(files, CheckpointMeta(session_id="s"))
    overwrite(src / "pages.img", 3 * MiB, random.Random(62).randbytes(MiB))
    child = repo.write_checkpoint(files, CheckpointMeta(session_id="s", parent_id=parent.checkpoint_id))
    return src, parent.checkpoint_id, child.checkpoint_id


@pytest.mark.parametrize("direction", ["local-to-s3", "s3-to-local"])
def test_export_import_into_an_empty_repository_on_another_backend(
        s3_server: S3Server, tmp_path: Path, direction: str) -> None:
    local = LocalBackend(tmp_path / "store")
    s3 = s3_server.backend()
    source_backend, target_backend = (local, s3) if direction == "local-to-s3" else (s3, local)
    source = Repository.init(source_backend, config=RepoConfig(pack_target_size=2 * MiB))
    src, parent_id, child_id = build_source(tmp_path, source)
    archive = tmp_path / "child.ksx"
    progress: list[tuple[int, int]] = []
    with open(archive, "wb") as out:
        source.export_checkpoint(child_id, out, lambda n, total: progress.append((n, total)))
    assert progress and sum(n for n, _ in progress) == progress[-1][1]

    target = Repository.open(target_backend)
    with open(archive, "rb") as inp:
        imported = target.import_checkpoint(inp)
    assert imported.checkpoint_id == child_id and imported.parent_id == parent_id
    assert imported.id == source.get_manifest(child_id).id
    target.read_checkpoint(child_id, tmp_path / "restored")
    assert same_tree(src, tmp_path / "restored")
    assert target.verify().ok
    # The same archive again is a no-op, not an error.
    with open(archive, "rb") as inp:
        assert target.import_checkpoint(inp).id == imported.id
    assert [m.checkpoint_id for m in target.list_checkpoints()] == [child_id]


def test_archive_holds_only_the_checkpoints_chunks(tmp_path: Path) -> None:
    repo = Repository.open(LocalBackend(tmp_path / "store"))
    small = tmp_path / "small"
    small.write_bytes(b"tiny state\n" * 100)
    big = tmp_path / "big"
    write_memory_image(big, 8 * MiB, seed=63, random_share=0.9)
    repo.write_checkpoint([ImageFile("big", big, "memory")], CheckpointMeta(session_id="other"))
    m = repo.write_checkpoint([ImageFile("small", small)], CheckpointMeta(session_id="s"))
    out = io.BytesIO()
    repo.export_checkpoint(m.checkpoint_id, out)
    assert len(out.getvalue()) < 4096


@pytest.fixture
def archive_bytes(tmp_path: Path) -> bytes:
    repo = Repository.init(LocalBackend(tmp_path / "a"), config=RepoConfig(pack_target_size=MiB))
    _src, _parent, child = build_source(tmp_path, repo)
    out = io.BytesIO()
    repo.export_checkpoint(child, out)
    return out.getvalue()


@pytest.mark.parametrize("seed", range(5))
def test_a_damaged_archive_is_refused_and_nothing_published(archive_bytes: bytes, tmp_path: Path,
                                                           seed: int) -> None:
    data = bytearray(archive_bytes)
    data[random.Random(seed).randrange(len(data))] ^= 0x04
    target = Repository.open(LocalBackend(tmp_path / "b"))
    with pytest.raises(ArchiveError):
        target.import_checkpoint(io.BytesIO(bytes(data)))
    assert target.list_checkpoints() == []
    assert list(target.backend.list("refs/")) == []


def test_a_truncated_archive_is_refused(archive_bytes: bytes, tmp_path: Path) -> None:
    target = Repository.open(LocalBackend(tmp_path / "b"))
    for cut in (5, len(archive_bytes) // 2, len(archive_bytes) - 1):
        with pytest.raises(ArchiveError):
            target.import_checkpoint(io.BytesIO(archive_bytes[:cut]))
    assert target.list_checkpoints() == []
    target.gc()  # and what the failed imports stored is reclaimed
    assert list(target.backend.list("packs/")) == []
