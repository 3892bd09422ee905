"""Path safety and stat of the volume content code (keepstate/volume/paths.py), on real directories."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from keepstate.errors import BadRequest, Conflict, NotFound, PayloadTooLarge
from keepstate.volume.paths import VolumeRoot, parts_of


@pytest.fixture
def vol(tmp_path: Path) -> VolumeRoot:
    (tmp_path / "fs" / "data").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("host secret")
    return VolumeRoot(tmp_path / "fs" / "data", tmp_path / "fs" / ".uploads")


def write(vol: VolumeRoot, path: str, data: bytes, force: bool = False) -> dict[str, object]:
    up = vol.begin_upload(path, force, len(data))
    try:
        up.write(data)
        return up.commit(None, None, None)
    except BaseException:
        up.abort()
        raise


def read(vol: VolumeRoot, path: str) -> bytes:
    fd, size = vol.open_file(path)
    try:
        return os.read(fd, size + 1)
    finally:
        os.close(fd)


def test_parts_normalise_and_refuse_traversal() -> None:
    assert parts_of("/a//b/./c/") == ["a", "b", "c"] and parts_of("a/b") == ["a", "b"] and parts_of("/") == []
    for bad, why in (("", "required"), ("a/../b", "traversal"), ("..", "traversal"), ("/x\0y", "NUL"),
                     ("/" + "n" * 256, "longer"), ("/a" * 3000, "longer")):
        with pytest.raises(BadRequest, match=why):
            parts_of(bad)


def test_write_read_stat_and_list(vol: VolumeRoot) -> None:
    e = write(vol, "/dir/sub/f.txt", b"hello")  # parents are made
    assert (e["name"], e["type"], e["path"], e["size"], e["mode"]) == ("f.txt", "file", "/dir/sub/f.txt", 5, 0o644)
    assert read(vol, "dir/sub/f.txt") == b"hello"
    d = vol.stat("/dir")
    assert d["type"] == "directory" and d["mode"] == 0o755 and d["path"] == "/dir"
    assert str(d["mtime"]).endswith("Z") and "uid" in d and "gid" in d
    assert [x["path"] for x in vol.listdir("/")] == ["/dir"]
    assert [x["path"] for x in vol.listdir("/", depth=3)] == ["/dir", "/dir/sub", "/dir/sub/f.txt"]
    assert vol.stat("/")["type"] == "directory"
    with pytest.raises(NotFound):
        vol.stat("/nope")
    with pytest.raises(NotFound):
        vol.listdir("/nope")
    with pytest.raises(BadRequest, match="not a directory"):
        vol.listdir("/dir/sub/f.txt")
    with pytest.raises(BadRequest, match="depth"):
        vol.listdir("/", depth=0)
    with pytest.raises(BadRequest, match="directory"):
        vol.open_file("/dir")


def test_overwrite_needs_force_and_keeps_the_old_bytes_until_the_rename(vol: VolumeRoot) -> None:
    write(vol, "/f", b"one")
    with pytest.raises(Conflict, match="force"):
        write(vol, "/f", b"two")
    up = vol.begin_upload("/f", True, None)
    up.write(b"three")
    assert read(vol, "/f") == b"one"  # the upload is elsewhere until it is complete
    up.commit(None, None, 0o600)
    assert read(vol, "/f") == b"three" and vol.stat("/f")["mode"] == 0o600
    assert os.listdir(vol.uploads) == []
    write(vol, "/d/x", b"x")
    with pytest.raises(Conflict, match="is a directory"):
        write(vol, "/d", b"y", force=True)


def test_mkdir_conflicts_and_force(vol: VolumeRoot) -> None:
    vol.mkdir("/a")
    with pytest.raises(Conflict, match="exists"):
        vol.mkdir("/a")
    assert vol.mkdir("/a", force=True)["type"] == "directory"
    with pytest.raises(NotFound):
        vol.mkdir("/x/y/z")
    e = vol.mkdir("/x/y/z", force=True, mode=0o700)
    assert e["path"] == "/x/y/z" and e["mode"] == 0o700
    write(vol, "/file", b"")
    with pytest.raises(Conflict, match="not a directory"):
        vol.mkdir("/file/sub", force=True)


def test_symlinks_that_leave_the_volume_are_refused_everywhere(vol: VolumeRoot, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    os.symlink(outside, vol.root / "abs")  # what a sandbox can leave behind
    os.symlink("../../outside", vol.root / "rel")
    os.symlink("../../outside/secret", vol.root / "file-link")
    for path in ("/abs/secret", "/rel/secret", "/file-link"):
        with pytest.raises(BadRequest, match="out of the volume"):
            vol.open_file(path)
    for op in (lambda: vol.listdir("/abs"), lambda: vol.mkdir("/abs/new"), lambda: vol.stat("/rel/secret"),
               lambda: vol.remove("/abs/secret"), lambda: write(vol, "/abs/planted", b"x"),
               lambda: vol.chattr("/rel/secret", None, None, 0o777)):
        with pytest.raises(BadRequest, match="out of the volume"):
            op()
    assert sorted(os.listdir(outside)) == ["secret"] and (outside / "secret").read_text() == "host secret"
    assert stat.S_IMODE((outside / "secret").stat().st_mode) != 0o777
    # The link itself is an entry like any other: stat shows it, delete removes it (not its target).
    e = vol.stat("/abs")
    assert e["type"] == "symlink" and e["target"] == str(outside)
    vol.remove("/abs")
    assert outside.exists() and not os.path.lexists(vol.root / "abs")
    # Overwriting a link with force replaces the link, never writes through it.
    write(vol, "/file-link", b"mine", force=True)
    assert (outside / "secret").read_text() == "host secret" and read(vol, "/file-link") == b"mine"
    with pytest.raises(BadRequest, match="symlink"):
        vol.chattr("/rel", None, None, 0o700)


def test_symlinks_inside_the_volume_are_followed_for_parents(vol: VolumeRoot) -> None:
    write(vol, "/real/f", b"x")
    os.symlink("real", vol.root / "alias")
    assert read(vol, "/alias/f") == b"x"
    assert [e["path"] for e in vol.listdir("/alias")] == ["/alias/f"]


def test_only_regular_files_are_read(vol: VolumeRoot) -> None:
    os.mkfifo(vol.root / "fifo")
    with pytest.raises(BadRequest, match="not a regular file"):
        vol.open_file("/fifo")  # and it did not block
    assert vol.stat("/fifo")["type"] == "unknown"


def test_remove_and_chattr(vol: VolumeRoot) -> None:
    write(vol, "/d/e/f", b"x")
    assert vol.chattr("/d/e/f", 1234, 4321, 0o640) | {} and vol.stat("/d/e/f")["uid"] == 1234
    assert (vol.stat("/d/e/f")["gid"], vol.stat("/d/e/f")["mode"]) == (4321, 0o640)
    vol.remove("/d")
    with pytest.raises(NotFound):
        vol.stat("/d")
    with pytest.raises(NotFound):
        vol.remove("/d")
    with pytest.raises(BadRequest, match="root"):
        vol.remove("/")


def test_the_dir_backend_quota(vol: VolumeRoot) -> None:
    vol.quota = 64 << 10
    with pytest.raises(PayloadTooLarge, match="free space"):
        vol.begin_upload("/big", False, 1 << 20)
    up = vol.begin_upload("/big", False, None)  # chunked: no length told
    with pytest.raises(PayloadTooLarge, match="quota"):
        for _ in range(32):
            up.write(b"x" * 4096)
    up.abort()
    assert os.listdir(vol.uploads) == [] and not os.path.lexists(vol.root / "big")
