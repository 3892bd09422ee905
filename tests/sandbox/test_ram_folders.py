"""The per-data-directory folders in RAM (/dev/shm) that checkpoint images pass through are not left behind."""

from __future__ import annotations

from pathlib import Path

from keepstate.sandbox.durable import HOME_MARK, sweep_ram_folders


def test_folders_of_deleted_data_directories_are_swept(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    live_home, dead_home = tmp_path / "live", tmp_path / "dead"
    live_home.mkdir()  # a data directory that exists is alive (an empty one too); `dead_home` never existed
    folders = {}
    for name, home in (("keepstate-live", live_home), ("keepstate-dead", dead_home)):
        folder = root / name
        (folder / "ckpt-1").mkdir(parents=True)
        (folder / "ckpt-1" / "pages.img").write_bytes(b"x" * 4096)
        (folder / HOME_MARK).write_text(str(home))
        folders[name] = folder
    unmarked = root / "keepstate-unmarked"
    unmarked.mkdir()
    other = root / "not-ours"
    other.mkdir()

    assert sweep_ram_folders(root) == [folders["keepstate-dead"]]
    assert not folders["keepstate-dead"].exists()
    assert (folders["keepstate-live"] / "ckpt-1" / "pages.img").exists()  # a running server's image is kept
    assert unmarked.exists() and other.exists()  # whose they are cannot be told: left alone
