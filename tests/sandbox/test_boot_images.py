"""Boot images (keepstate/sandbox/boot_images.py): a template's first fresh boot is checkpointed before its /init,
and later sandboxes of the same build and limits are restored from it, each its own; a bad image is discarded and
the sandbox boots. On the fake runtime (counting its creates and restores) and once on gVisor."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from keepstate.runtime import cgroups
from keepstate.testing import FakeRuntime

from .conftest import Served, serving
from .test_races import read_file, write_file


def fake(s: Served) -> FakeRuntime:
    assert isinstance(s.runtime, FakeRuntime)
    return s.runtime


async def create(s: Served, **body: object) -> tuple[str, str]:
    status, sbx = await s.call("POST", "/sandboxes", {"templateID": "base", **body})
    assert status == 201, sbx
    return sbx["sandboxID"], sbx["envdAccessToken"]


async def test_the_first_boot_is_captured_and_the_next_sandboxes_are_restored_from_it() -> None:
    async with serving(pool_size=0, boot_images=True) as s:
        first, token1 = await create(s)
        assert fake(s).calls.get("create") == 1 and fake(s).calls.get("checkpoint") == 1
        images = [p for p in (s.home / "boot-images").iterdir() if not p.name.startswith(".")]
        assert len(images) == 1 and (images[0] / "ready").exists()
        second, token2 = await create(s)
        third, token3 = await create(s)
        assert fake(s).calls.get("create") == 1 and fake(s).calls.get("restore") == 2
        assert len({token1, token2, token3}) == 3
        # Each is its own: a file written in one is in no other, and one's token opens no other.
        await write_file(s, second, token2, "/home/user/mine", b"second's")
        assert await read_file(s, second, token2, "/home/user/mine") == b"second's"
        async with s.http.get(f"{s.url}/files", params={"path": "/home/user/mine", "username": "user"},
                              headers={"E2b-Sandbox-Id": third, "X-Access-Token": token3}) as r:
            assert r.status == 404
        async with s.http.get(f"{s.url}/files", params={"path": "/home/user/mine", "username": "user"},
                              headers={"E2b-Sandbox-Id": third, "X-Access-Token": token2}) as r:
            assert r.status == 401
        assert fake(s).violations == []  # no connection was open into the instance it was captured from


async def test_other_limits_get_an_image_of_their_own() -> None:
    async with serving(pool_size=0, boot_images=True) as s:
        await create(s)
        await create(s, memoryMB=1024)
        await create(s, memoryMB=1024)
        assert fake(s).calls.get("create") == 2 and fake(s).calls.get("restore") == 1


async def test_a_bad_image_is_discarded_and_the_sandbox_boots() -> None:
    async with serving(pool_size=0, boot_images=True) as s:
        await create(s)
        (image,) = [p for p in (s.home / "boot-images").iterdir() if not p.name.startswith(".")]
        for f in image.iterdir():
            if f.name != "ready":
                f.unlink()  # the image is gone from under its marker
        sid, token = await create(s)
        assert fake(s).calls.get("create") == 2  # booted after the failed restore
        await write_file(s, sid, token, "/home/user/x", b"works")
        assert await read_file(s, sid, token, "/home/user/x") == b"works"
        # ... and that boot wrote a new image, which the next create restores.
        restores = fake(s).calls.get("restore", 0)
        await create(s)
        assert fake(s).calls.get("restore") == restores + 1


async def test_concurrent_creates_capture_one_image_and_all_work() -> None:
    async with serving(pool_size=0, boot_images=True) as s:
        made = await asyncio.gather(*(create(s) for _ in range(6)))
        assert len({sid for sid, _ in made}) == 6
        for sid, token in made:
            await write_file(s, sid, token, "/home/user/id", sid.encode())
        for sid, token in made:
            assert await read_file(s, sid, token, "/home/user/id") == sid.encode()
        assert fake(s).calls.get("checkpoint") == 1


async def test_off_means_every_sandbox_boots() -> None:
    async with serving(pool_size=0, boot_images=False) as s:
        await create(s)
        await create(s)
        assert fake(s).calls.get("create") == 2 and not fake(s).calls.get("checkpoint")
        assert not (s.home / "boot-images").exists() or not any((s.home / "boot-images").iterdir())


async def test_a_server_start_removes_the_images_of_the_last() -> None:
    runtime = FakeRuntime()
    async with serving(pool_size=0, boot_images=True, runtime=runtime) as s:
        await create(s)
        home = s.home
        assert any((home / "boot-images").iterdir())
    async with serving(pool_size=0, boot_images=True, runtime=runtime, home=home) as s2:
        assert not (s2.home / "boot-images").exists()
        creates = runtime.calls.get("create", 0)
        await create(s2)
        assert runtime.calls.get("create") == creates + 1  # booted: the old image was not used
    runtime.close()


async def test_restored_gvisor_sandboxes_are_each_its_own() -> None:
    """On gVisor: the first sandbox is captured, the next two restored from it, each with its own address, token
    and files."""
    async with serving("gvisor", pool_size=0, boot_images=True) as s:
        made = [await create(s) for _ in range(3)]
        (image,) = [p for p in (s.home / "boot-images").iterdir() if not p.name.startswith(".")]
        assert (image / "ready").exists()
        for i, (sid, token) in enumerate(made):
            await write_file(s, sid, token, "/home/user/who", f"sandbox {i}".encode())
        for i, (sid, token) in enumerate(made):
            assert await read_file(s, sid, token, "/home/user/who") == f"sandbox {i}".encode()
        assert len({s.manager.records[sid].address for sid, _ in made}) == 3
        # A restore runs pinned to one CPU (runtime/affinity.py); once it runs, every thread of it has them all.
        every = os.sched_getaffinity(0)
        for sid, _ in made[1:]:
            folders = cgroups.paths(cgroups.CGROUP_PARENT, s.manager.records[sid].runtime_name)
            tids = cgroups.pids(folders)
            assert len(tids) > 5, (sid, folders, tids)
            masks = {}
            for tid in tids:
                try:
                    masks[tid] = os.sched_getaffinity(tid)
                except ProcessLookupError:  # a thread that ended since
                    continue
            assert masks and all(m == every for m in masks.values()), (every, masks)
        async with s.http.get(f"{s.url}/files", params={"path": "/home/user/who", "username": "user"},
                              headers={"E2b-Sandbox-Id": made[1][0], "X-Access-Token": made[2][1]}) as r:
            assert r.status == 401


async def test_a_filesystem_only_resume_is_a_boot_of_its_own_not_the_images(tmp_path: Path) -> None:
    """A pooled sandbox restored from the build's boot image shares that boot (its kernel's boot_id); a
    filesystem-only resume is a new boot (E2B's SDK checks a new boot_id), so it boots anew rather than claim one."""
    async with serving(pool_size=1, boot_images=True, store_url=f"file://{tmp_path / 'store'}") as s:
        async with asyncio.timeout(30):
            while not s.manager.pools or not next(iter(s.manager.pools.values())).ready():  # the first boot
                await asyncio.sleep(0.05)
        pool = next(iter(s.manager.pools.values()))
        status, made = await s.call("POST", "/sandboxes", {"templateID": "base", "timeout": 300})  # claims it
        assert status == 201, made
        sid, token = made["sandboxID"], made["envdAccessToken"]
        async with asyncio.timeout(30):
            while not pool.ready():  # refilled: restored from the image the first boot captured
                await asyncio.sleep(0.05)
        assert all(r.settings.from_image for r in pool.ready())
        await write_file(s, sid, token, "/home/user/kept.txt", b"across a new boot")
        assert (await s.call("POST", f"/sandboxes/{sid}/pause", {"memory": False}))[0] == 204
        boots = s.runtime.calls.get("create", 0)
        status, _ = await s.call("POST", f"/v2/sandboxes/{sid}/connect", {"timeout": 60})
        assert status == 201
        assert s.runtime.calls.get("create", 0) == boots + 1  # booted, not the image's restore taken from the pool
        assert len(pool.ready()) == 1
        assert await read_file(s, sid, token, "/home/user/kept.txt") == b"across a new boot"
