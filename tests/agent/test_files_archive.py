"""The filesystem-only pause's diff and its application (keepstate/agent/files_archive.py), on host directories.

In a sandbox, gVisor's overlay shows an entry that was never copied up with its template's attributes. Here a
hard-linked copy of a "template" plays the overlay: its files share the template's inodes (the same attributes),
until the test changes one the way a copy-up would (a new file in its place).
"""

from __future__ import annotations

import io
import os
import subprocess
from pathlib import Path

import pytest

from keepstate.agent import files_archive as fa
from keepstate.agent.asgi import HTTPError


def template(root: Path) -> Path:
    lower = root / "lower"
    (lower / "etc").mkdir(parents=True)
    (lower / "usr/share/doc").mkdir(parents=True)
    (lower / "etc/motd").write_text("welcome\n")
    (lower / "etc/issue").write_text("debian\n")
    (lower / "usr/share/doc/readme").write_text("docs\n")
    (lower / "usr/bin").mkdir()
    (lower / "usr/bin/tool").write_text("#!/bin/sh\n")
    return lower


def overlay(root: Path, lower: Path) -> Path:
    upper = root / "sandbox"
    subprocess.run(["cp", "-al", str(lower), str(upper)], check=True)  # files share inodes; directories are new
    for d, _, _ in os.walk(lower):  # as the overlay shows them: a directory never copied up has its lower's times
        st = os.stat(d)
        os.utime(upper / os.path.relpath(d, lower), ns=(st.st_atime_ns, st.st_mtime_ns))
    return upper


def entries(upper: Path, lower: Path) -> list[tuple[str, str]]:
    return [(k, rel) for k, rel, _ in fa.changes(str(upper), str(lower), skip=set())]


def test_an_untouched_copy_has_only_directories_to_report(tmp_path: Path) -> None:
    lower = template(tmp_path)
    upper = overlay(tmp_path, lower)
    # directories here are new (their ctime differs) but every file is the template's own
    assert {k for k, _ in entries(upper, lower)} <= {"entry"}
    assert all((upper / rel).is_dir() for _, rel in entries(upper, lower))


def test_changes_deletions_and_new_entries_round_trip(tmp_path: Path) -> None:
    lower = template(tmp_path)
    upper = overlay(tmp_path, lower)
    (upper / "etc/motd").unlink()
    (upper / "etc/issue").unlink()
    (upper / "etc/issue").write_text("changed\n")  # a copy-up: a file of its own in its place
    (upper / "home/user/project").mkdir(parents=True)
    (upper / "home/user/project/data.bin").write_bytes(os.urandom(300_000))
    os.symlink("project/data.bin", upper / "home/user/link")
    os.link(upper / "home/user/project/data.bin", upper / "home/user/hard")
    os.chmod(upper / "home/user/project/data.bin", 0o640)
    os.utime(upper / "home/user/project/data.bin", ns=(1_700_000_000_123_456_789,) * 2)
    os.mkfifo(upper / "home/user/fifo")

    found = entries(upper, lower)
    assert ("whiteout", "etc/motd") in found and ("entry", "etc/issue") in found
    assert ("entry", "usr/share/doc/readme") not in found and ("entry", "usr/bin/tool") not in found

    buf = io.BytesIO()
    count = fa.write_tar(buf, str(upper), str(lower), skip=set())
    assert count == len(found)

    # a fresh boot of the template, then the archive applied to it
    (tmp_path / "fresh").mkdir()
    target = overlay(tmp_path / "fresh", lower)
    buf.seek(0)
    assert fa.apply_tar(buf, str(target), skip=set()) == count
    assert not (target / "etc/motd").exists()
    assert (target / "etc/issue").read_text() == "changed\n"
    assert (lower / "etc/issue").read_text() == "debian\n"  # never written through a shared inode
    data = target / "home/user/project/data.bin"
    assert data.read_bytes() == (upper / "home/user/project/data.bin").read_bytes()
    assert oct(data.stat().st_mode & 0o777) == "0o640"
    assert abs(data.stat().st_mtime_ns - 1_700_000_000_123_456_789) < 1000
    assert os.readlink(target / "home/user/link") == "project/data.bin"
    assert (target / "home/user/hard").stat().st_ino == data.stat().st_ino
    assert (target / "home/user/fifo").is_fifo()
    assert (target / "usr/share/doc/readme").read_text() == "docs\n"


def test_a_type_change_replaces_the_entry(tmp_path: Path) -> None:
    lower = template(tmp_path)
    upper = overlay(tmp_path, lower)
    (upper / "etc/motd").unlink()
    (upper / "etc/motd").mkdir()
    (upper / "etc/motd/inside").write_text("now a directory")
    buf = io.BytesIO()
    fa.write_tar(buf, str(upper), str(lower), skip=set())
    (tmp_path / "fresh").mkdir()
    target = overlay(tmp_path / "fresh", lower)
    buf.seek(0)
    fa.apply_tar(buf, str(target), skip=set())
    assert (target / "etc/motd/inside").read_text() == "now a directory"


def test_mount_points_are_not_the_sandbox_disk(tmp_path: Path) -> None:
    lower = template(tmp_path)
    upper = overlay(tmp_path, lower)
    (upper / "mnt/volume").mkdir(parents=True)
    (upper / "mnt/volume/theirs").write_text("a volume's file")
    skip = {str(upper / "mnt/volume")}
    found = [rel for _, rel, _ in fa.changes(str(upper), str(lower), skip=skip)]
    assert "mnt" in found and not any(rel.startswith("mnt/volume") for rel in found)


def test_an_archive_cannot_name_paths_outside(tmp_path: Path) -> None:
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escape")
        tar.addfile(info, io.BytesIO(b""))
    buf.seek(0)
    with pytest.raises(HTTPError) as err:
        fa.apply_tar(buf, str(tmp_path / "root"), skip=set())
    assert err.value.status == 400 and "escape" in err.value.message
    assert not (tmp_path / "escape").exists()
