"""Writing and reading checkpoints, on every backend: round trip, dedupe, lineage, listing, deletion, concurrency."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from keepstate.store import (
    Backend,
    CheckpointExists,
    CheckpointMeta,
    CheckpointNotFound,
    EventRef,
    ImageFile,
    LocalBackend,
    Repository,
    RepositoryError,
)
from tests.store.conftest import MiB, overwrite, same_tree, write_memory_image, write_text_file


@pytest.fixture
def image(tmp_path: Path) -> tuple[Path, list[ImageFile]]:
    """A mixed checkpoint image: a 64 MiB memory file (random + zero pages) and some text files."""
    src = tmp_path / "image"
    src.mkdir()
    write_memory_image(src / "pages.img", 64 * MiB, seed=1)
    write_text_file(src / "rootfs" / "etc" / "app.conf", 300_000, seed=2)
    write_text_file(src / "rootfs" / "var" / "log.txt", 2 * MiB, seed=3)
    (src / "rootfs" / "empty").write_bytes(b"")
    os.chmod(src / "rootfs" / "etc" / "app.conf", 0o600)
    files = [ImageFile("pages.img", src / "pages.img", "memory")] + [
        ImageFile(str(p.relative_to(src)), p, "file") for p in sorted((src / "rootfs").rglob("*")) if p.is_file()]
    return src, files


def meta(**kw: object) -> CheckpointMeta:
    base: dict[str, object] = dict(session_id="sess-1", template_id="base", template_digest="sha256:abc",
                                   runsc_release="20240729", cpu_features=("sse4_2", "avx2"),
                                   event=EventRef(7, "ab" * 32), labels={"why": "test"},
                                   sizes={"memory": 64 * MiB})
    base.update(kw)
    return CheckpointMeta(**base)  # type: ignore[arg-type]


def test_round_trip_of_a_mixed_image(backend: Backend, image: tuple[Path, list[ImageFile]],
                                     tmp_path: Path) -> None:
    src, files = image
    repo = Repository.open(backend)
    written = repo.write_checkpoint(files, meta())
    restored = repo.read_checkpoint(written.checkpoint_id, tmp_path / "out")
    assert same_tree(src, tmp_path / "out")
    assert (tmp_path / "out" / "rootfs" / "etc" / "app.conf").stat().st_mode & 0o777 == 0o600
    assert restored == written
    got = repo.get_manifest(written.checkpoint_id).meta
    assert (got.runsc_release, got.template_digest, got.cpu_features) == ("20240729", "sha256:abc",
                                                                         ("sse4_2", "avx2"))
    assert got.event == EventRef(7, "ab" * 32) and got.labels == {"why": "test"}
    assert got.stats["size"] == sum(f.path.stat().st_size for f in files)
    # Zero pages are stored once: far less than the image's size is stored.
    assert repo.stored_bytes() < 0.5 * got.stats["size"]


def test_restored_memory_image_is_sparse(tmp_path: Path) -> None:
    img = tmp_path / "pages.img"
    with open(img, "wb") as f:  # one block in eight holds data
        for i in range(256):
            f.write(os.urandom(64 * 1024) if i % 8 == 0 else bytes(64 * 1024))
    repo = Repository.open(LocalBackend(tmp_path / "store"))
    m = repo.write_checkpoint([ImageFile("pages.img", img, "memory")], meta())
    repo.read_checkpoint(m.checkpoint_id, tmp_path / "out")
    out = tmp_path / "out" / "pages.img"
    assert out.read_bytes() == img.read_bytes()
    assert out.stat().st_blocks * 512 < out.stat().st_size // 2


def test_second_checkpoint_after_a_1mib_change_stores_under_2mib(backend: Backend, tmp_path: Path) -> None:
    img = tmp_path / "pages.img"
    write_memory_image(img, 64 * MiB, seed=5, random_share=0.5)
    text = tmp_path / "notes.txt"
    write_text_file(text, 4 * MiB, seed=6)
    repo = Repository.open(backend)
    first = repo.write_checkpoint([ImageFile("pages.img", img, "memory"), ImageFile("notes.txt", text)], meta())
    before = repo.stored_bytes()
    overwrite(img, 20 * MiB + 8192, os.urandom(MiB))  # in place, page aligned but not block aligned
    with open(text, "r+b") as f:  # an insertion near the start of a file shifts everything after it
        rest = f.read()
        f.seek(0)
        f.write(b"inserted line\n" + rest)
    second = repo.write_checkpoint([ImageFile("pages.img", img, "memory"), ImageFile("notes.txt", text)],
                                   meta(parent_id=first.checkpoint_id))
    added = repo.stored_bytes() - before
    assert added < 2 * MiB, added
    assert second.meta.stats["added_bytes"] < 2 * MiB
    repo.read_checkpoint(second.checkpoint_id, tmp_path / "out")
    assert (tmp_path / "out" / "pages.img").read_bytes() == img.read_bytes()
    assert (tmp_path / "out" / "notes.txt").read_bytes() == text.read_bytes()


def test_lineage_list_and_delete(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"state")
    repo = Repository.open(LocalBackend(tmp_path / "store"))
    root = repo.write_checkpoint([ImageFile("f", f)], meta())
    child = repo.write_checkpoint([ImageFile("f", f)], meta(parent_id=root.checkpoint_id))
    fork = repo.write_checkpoint([ImageFile("f", f)], meta(parent_id=child.checkpoint_id, session_id="fork-1"))
    assert [m.checkpoint_id for m in repo.lineage(fork.checkpoint_id)] == [
        fork.checkpoint_id, child.checkpoint_id, root.checkpoint_id]
    assert [m.checkpoint_id for m in repo.list_checkpoints()] == [
        root.checkpoint_id, child.checkpoint_id, fork.checkpoint_id]
    repo.delete_checkpoint(child.checkpoint_id)
    assert [m.checkpoint_id for m in repo.lineage(fork.checkpoint_id)] == [fork.checkpoint_id]
    with pytest.raises(CheckpointNotFound):
        repo.get_manifest(child.checkpoint_id)
    with pytest.raises(CheckpointNotFound):
        repo.delete_checkpoint(child.checkpoint_id)
    # Chunks are shared, not inherited: the fork still restores with its parent gone.
    repo.read_checkpoint(fork.checkpoint_id, tmp_path / "out")
    assert (tmp_path / "out" / "f").read_bytes() == b"state"


def test_refusals(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x")
    backend = LocalBackend(tmp_path / "store")
    with pytest.raises(RepositoryError):
        Repository.open(backend, create=False)
    repo = Repository.open(backend)
    with pytest.raises(RepositoryError):
        Repository.init(backend)
    m = repo.write_checkpoint([ImageFile("f", f)], meta(checkpoint_id="fixed-id"))
    with pytest.raises(CheckpointExists):
        repo.write_checkpoint([ImageFile("f", f)], meta(checkpoint_id="fixed-id"))
    with pytest.raises(ValueError):
        repo.write_checkpoint([ImageFile("../escape", f)], meta())
    with pytest.raises(ValueError):
        repo.write_checkpoint([ImageFile("a", f), ImageFile("a", f)], meta())
    with pytest.raises(ValueError):
        repo.write_checkpoint([ImageFile("a", f, "disk")], meta())
    with pytest.raises(ValueError):
        meta(checkpoint_id="has space")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_bytes(b"keep me")
    with pytest.raises(FileExistsError):
        repo.read_checkpoint(m.checkpoint_id, tmp_path / "busy")
    assert (tmp_path / "busy" / "x").read_bytes() == b"keep me"
    (tmp_path / "empty").mkdir()
    repo.read_checkpoint(m.checkpoint_id, tmp_path / "empty")  # an empty directory is fine
    assert (tmp_path / "empty" / "f").read_bytes() == b"x"


def test_cache_dir_serves_immutable_objects(tmp_path: Path) -> None:
    f = tmp_path / "f"
    write_text_file(f, 200_000, seed=9)
    backend = LocalBackend(tmp_path / "store")
    repo = Repository.open(backend, cache_dir=tmp_path / "cache")
    m = repo.write_checkpoint([ImageFile("f", f)], meta())
    repo.read_checkpoint(m.checkpoint_id, tmp_path / "out1")
    assert list((tmp_path / "cache").rglob("manifests/*")) and list((tmp_path / "cache").rglob("index/*"))
    other = Repository.open(backend, cache_dir=tmp_path / "cache")
    other.read_checkpoint(m.checkpoint_id, tmp_path / "out2")
    assert (tmp_path / "out2" / "f").read_bytes() == f.read_bytes()


WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from keepstate.store import CheckpointMeta, ImageFile, Repository, backend_from_url
    repo = Repository.open(backend_from_url(sys.argv[1]))
    m = repo.write_checkpoint([ImageFile("pages.img", Path(sys.argv[2]), "memory")],
                              CheckpointMeta(session_id=sys.argv[3]))
    print(m.checkpoint_id)
""")


def test_two_processes_writing_to_one_repository(backend: Backend, tmp_path: Path) -> None:
    Repository.open(backend)  # create it first so both writers share one config
    url = backend.location if isinstance(backend, LocalBackend) else None
    if url is None:
        from tests.store.conftest import ACCESS_KEY, SECRET_KEY

        url = f"{backend.location}&access_key={ACCESS_KEY}&secret_key={SECRET_KEY}"
    images = []
    for i in range(2):
        img = tmp_path / f"img{i}"
        write_memory_image(img, 24 * MiB, seed=10 + i)
        overwrite(img, 0, bytes(4 * MiB))  # a shared region: both writers may store the same chunks
        images.append(img)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, url, str(img), f"s{i}"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i, img in enumerate(images)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    repo = Repository.open(backend)
    assert repo.verify().ok
    for (out, _), img in zip(outs, images, strict=True):
        dest = tmp_path / f"out-{out.strip()}"
        repo.read_checkpoint(out.strip(), dest)
        assert (dest / "pages.img").read_bytes() == img.read_bytes()


def test_restore_spans_coalesce_close_chunks_up_to_the_backend_read_span() -> None:
    from keepstate.store.pack import PackEntry
    from keepstate.store.restore import PackPlan

    plan = PackPlan(b"p" * 32)
    layout = [(0, 300_000), (300_000, 300_000), (600_000, 300_000), (900_000, 2_500_000), (5_000_000, 10)]
    for i, (offset, length) in enumerate(layout):
        plan.chunks[bytes([i]) * 32] = (PackEntry(bytes([i]) * 32, offset, length, length, 0), [(0, 0)])
    whole = [(start, length, [e.offset for e in entries]) for start, length, entries in plan.spans()]
    # 1.6 MB gap before the last chunk: beyond the coalescing gap, so two ranges
    assert whole == [(0, 3_400_000, [0, 300_000, 600_000, 900_000]), (5_000_000, 10, [5_000_000])]
    capped = [(start, length, [e.offset for e in entries]) for start, length, entries in plan.spans(1 << 20)]
    # at most 1 MiB a range, except a chunk longer than that on its own
    assert capped == [(0, 900_000, [0, 300_000, 600_000]), (900_000, 2_500_000, [900_000]),
                      (5_000_000, 10, [5_000_000])]
