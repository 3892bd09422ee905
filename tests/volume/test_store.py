"""The volume store (keepstate/volume/store.py) on both backends, with a real catalog."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from keepstate.db.catalog import Catalog
from keepstate.errors import BadRequest, Conflict, NotFound, PayloadTooLarge, Refused, Unauthorized
from keepstate.volume import Volumes

needs_loop = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mkfs.ext4") or
                                not Path("/dev/loop-control").exists(), reason="ext4 volumes need root and loops")


@pytest.fixture(params=["dir", pytest.param("ext4", marks=needs_loop)])
def store(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    cat = Catalog(tmp_path / "catalog.sqlite")
    vols = Volumes(tmp_path, cat, request.param, default_size_mb=16)
    yield vols
    vols.unmount_all()
    cat.close()


def test_create_authorize_and_destroy(store: Volumes) -> None:
    vol = store.create(*store.check_new("data", None))
    assert vol.size_mb == 16 and vol.token.startswith("vol_") and vol.volume_id.startswith("vol")
    assert store.get(vol.volume_id) == vol and [v.name for v in store.list()] == ["data"]
    data = store.data(vol.volume_id)
    assert data.is_dir() and sorted(os.listdir(data)) == [] and data.stat().st_uid == 1000
    assert store.authorize(vol.volume_id, f"Bearer {vol.token}") == vol
    for header, why in ((None, "missing"), ("Bearer ", "missing"), (vol.token, "missing"),
                        ("Bearer vol_wrong", "invalid")):
        with pytest.raises(Unauthorized, match=why):
            store.authorize(vol.volume_id, header)
    other = store.create("other", 16)
    with pytest.raises(Unauthorized):
        store.authorize(other.volume_id, f"Bearer {vol.token}")  # a token opens its own volume only
    with pytest.raises(NotFound):
        store.authorize("volnope", f"Bearer {vol.token}")
    with pytest.raises(Conflict, match="exists"):
        store.create("data", 16)
    with pytest.raises(Conflict, match="sandbox sbx1"):
        store.forget(vol.volume_id, ["sbx1"])
    with store.pinned(["data"]):
        with pytest.raises(Conflict, match="starting"):
            store.forget(vol.volume_id, [])
    store.forget(vol.volume_id, [])
    store.remove(vol.volume_id)
    assert not store.dir(vol.volume_id).exists()
    with pytest.raises(NotFound):
        store.get(vol.volume_id)
    with pytest.raises(BadRequest, match="not found"):
        with store.pinned(["data"]):
            pass
    with pytest.raises(Refused, match="no longer exists"):
        store.source(vol.volume_id, "data")


def test_names_and_sizes_are_checked(store: Volumes) -> None:
    for name in ("", "-x", "a/b", "a" * 64, 3, None, "..", "x y"):
        with pytest.raises(BadRequest, match="name"):
            store.check_new(name, None)
    for size in (0, 15, True, 1.5, "16", (1 << 20) + 1):
        with pytest.raises(BadRequest, match="sizeMB"):
            store.check_new("ok", size)
    assert store.check_new("A.b_c-1", 32) == ("A.b_c-1", 32)


def test_two_creates_of_one_name_race_and_one_wins(store: Volumes) -> None:
    results: list[object] = []

    def create() -> None:
        try:
            results.append(store.create("same", 16))
        except Conflict as exc:
            results.append(exc)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    made = [r for r in results if not isinstance(r, Conflict)]
    assert len(made) == 1 and len(results) == 4
    assert [v.name for v in store.list()] == ["same"]
    assert sorted(os.listdir(store.base)) == [store.list()[0].volume_id]  # the losers left nothing on disk


def test_restart_mounts_again_and_sweeps_leftovers(store: Volumes) -> None:
    vol = store.create("keep", 16)
    (store.data(vol.volume_id) / "f").write_text("kept")
    (store.base / "volhalfmade").mkdir()  # a create that crashed before its catalog row
    store.unmount_all()
    again = Volumes(store.base.parent, store.catalog, store.backend)
    again.mount_all()
    assert (again.data(vol.volume_id) / "f").read_text() == "kept"
    assert not (store.base / "volhalfmade").exists()


@needs_loop
def test_the_ext4_quota_is_a_full_disk_for_everyone(tmp_path: Path) -> None:
    cat = Catalog(tmp_path / "catalog.sqlite")
    store = Volumes(tmp_path, cat, "ext4")
    vol = store.create("small", 16)
    try:
        fs = store.dir(vol.volume_id) / "fs"
        assert os.path.ismount(fs)
        out = subprocess.run(["dd", "if=/dev/zero", f"of={store.data(vol.volume_id)}/big", "bs=1M", "count=32"],
                             capture_output=True, text=True)
        assert out.returncode != 0 and "No space left" in out.stderr  # what a sandbox's writer sees
        root = store.root(vol)
        with pytest.raises(PayloadTooLarge):
            root.begin_upload("/more", False, 8 << 20)
        up = root.begin_upload("/more", False, None)
        with pytest.raises(PayloadTooLarge, match="full"):
            for _ in range(64):
                up.write(b"x" * (256 << 10))
        up.abort()
        store.forget(vol.volume_id, [])
        store.remove(vol.volume_id)
        assert not os.path.ismount(fs) and not store.dir(vol.volume_id).exists()
    finally:
        store.unmount_all()
        cat.close()
