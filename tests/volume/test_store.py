"""The volume store (keepstate/volume/store.py) on both backends, with a real database (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from keepstate.db.engine import Database
from keepstate.errors import BadRequest, Conflict, NotFound, PayloadTooLarge, Refused, Unauthorized
from keepstate.testing.databases import database, db_url, postgres  # noqa: F401
from keepstate.volume import Volumes

needs_loop = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mkfs.ext4") or
                                not Path("/dev/loop-control").exists(), reason="ext4 volumes need root and loops")


@pytest.fixture(params=["dir", pytest.param("ext4", marks=needs_loop)])
async def store(request: pytest.FixtureRequest, tmp_path: Path,
                database: Database) -> AsyncIterator[Volumes]:  # noqa: F811
    vols = Volumes(tmp_path, database, request.param, default_size_mb=16)
    yield vols
    await vols.unmount_all()


async def test_create_authorize_and_destroy(store: Volumes) -> None:
    vol = await store.create(*store.check_new("data", None))
    assert vol.size_mb == 16 and vol.token.startswith("vol_") and vol.volume_id.startswith("vol")
    assert await store.get(vol.volume_id) == vol and [v.name for v in await store.list()] == ["data"]
    data = store.data(vol.volume_id)
    assert data.is_dir() and sorted(os.listdir(data)) == [] and data.stat().st_uid == 1000
    assert await store.authorize(vol.volume_id, f"Bearer {vol.token}") == vol
    for header, why in ((None, "missing"), ("Bearer ", "missing"), (vol.token, "missing"),
                        ("Bearer vol_wrong", "invalid")):
        with pytest.raises(Unauthorized, match=why):
            await store.authorize(vol.volume_id, header)
    other = await store.create("other", 16)
    with pytest.raises(Unauthorized):
        await store.authorize(other.volume_id, f"Bearer {vol.token}")  # a token opens its own volume only
    with pytest.raises(NotFound):
        await store.authorize("volnope", f"Bearer {vol.token}")
    with pytest.raises(Conflict, match="exists"):
        await store.create("data", 16)
    with pytest.raises(Conflict, match="sandbox sbx1"):
        await store.forget(vol.volume_id, lambda: ["sbx1"])
    async with store.pinned(["data"]):
        with pytest.raises(Conflict, match="starting"):
            await store.forget(vol.volume_id, lambda: [])
    await store.forget(vol.volume_id, lambda: [])
    store.remove(vol.volume_id)
    assert not store.dir(vol.volume_id).exists()
    with pytest.raises(NotFound):
        await store.get(vol.volume_id)
    with pytest.raises(BadRequest, match="not found"):
        async with store.pinned(["data"]):
            pass
    with pytest.raises(Refused, match="no longer exists"):
        await store.source(vol.volume_id, "data")


def test_names_and_sizes_are_checked(store: Volumes) -> None:
    for name in ("", "-x", "a/b", "a" * 64, 3, None, "..", "x y"):
        with pytest.raises(BadRequest, match="name"):
            store.check_new(name, None)
    for size in (0, 15, True, 1.5, "16", (1 << 20) + 1):
        with pytest.raises(BadRequest, match="sizeMB"):
            store.check_new("ok", size)
    assert store.check_new("A.b_c-1", 32) == ("A.b_c-1", 32)


async def test_two_creates_of_one_name_race_and_one_wins(store: Volumes) -> None:
    async def create() -> object:
        try:
            return await store.create("same", 16)
        except Conflict as exc:
            return exc

    results = await asyncio.gather(*(create() for _ in range(4)))
    made = [r for r in results if not isinstance(r, Conflict)]
    assert len(made) == 1 and len(results) == 4
    assert [v.name for v in await store.list()] == ["same"]
    assert sorted(os.listdir(store.base)) == [(await store.list())[0].volume_id]  # the losers left nothing on disk


async def test_two_servers_creating_one_name_one_wins(store: Volumes, database: Database) -> None:  # noqa: F811
    """The same race between two processes on one database: the name's uniqueness is the database's (a store's
    own look-up first does not see the other's create)."""
    other_db = await Database.open(database.url)
    try:
        other = Volumes(store.base.parent, other_db, store.backend, default_size_mb=16)
        results = await asyncio.gather(*(s.create("same", 16) for s in (store, other, store, other)),
                                       return_exceptions=True)
        assert sum(not isinstance(r, BaseException) for r in results) == 1
        assert all(isinstance(r, Conflict) for r in results if isinstance(r, BaseException)), results
        assert [v.name for v in await other.list()] == ["same"]
        assert sorted(os.listdir(store.base)) == [(await store.list())[0].volume_id]
    finally:
        await other_db.close()


async def test_restart_mounts_again_and_sweeps_leftovers(store: Volumes, database: Database) -> None:  # noqa: F811
    vol = await store.create("keep", 16)
    (store.data(vol.volume_id) / "f").write_text("kept")
    (store.base / "volhalfmade").mkdir()  # a create that crashed before its database row
    await store.unmount_all()
    again_db = await Database.open(database.url)  # what the server has after a restart
    try:
        again = Volumes(store.base.parent, again_db, store.backend)
        await again.mount_all()
        assert (again.data(vol.volume_id) / "f").read_text() == "kept"
        assert not (store.base / "volhalfmade").exists()
        assert await again.get(vol.volume_id) == vol
    finally:
        await again_db.close()


@needs_loop
async def test_the_ext4_quota_is_a_full_disk_for_everyone(tmp_path: Path, database: Database) -> None:  # noqa: F811
    store = Volumes(tmp_path, database, "ext4")
    vol = await store.create("small", 16)
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
        await store.forget(vol.volume_id, lambda: [])
        store.remove(vol.volume_id)
        assert not os.path.ismount(fs) and not store.dir(vol.volume_id).exists()
    finally:
        await store.unmount_all()
