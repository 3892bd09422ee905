"""Filesystem-only snapshots and forks (E2B: `create_snapshot(mode="filesystem")`, fork `memory: false`; issue 28):
the sandbox's files are exported while its processes are stopped, and it runs on; each sandbox made from them is a
cold boot with those files (a new instance, booted, not restored), diverging from the others."""

from __future__ import annotations

from pathlib import Path

from ..sandbox.test_races import read_file, write_file
from .conftest import serving


async def test_a_filesystem_only_snapshot_and_fork_make_cold_boots_with_the_files(tmp_path: Path) -> None:
    async with serving(store_url=f"file://{tmp_path / 'store'}", pool_size=0) as s:
        status, made = await s.call("POST", "/sandboxes", {"templateID": "base", "timeout": 300})
        assert status == 201, made
        sid, token = made["sandboxID"], made["envdAccessToken"]
        await write_file(s, sid, token, "/home/user/kept.txt", b"files only")
        boots, restores = s.runtime.calls.get("create", 0), s.runtime.calls.get("restore", 0)

        status, snap = await s.call("POST", f"/sandboxes/{sid}/snapshots", {"memory": False, "name": "files-only"})
        assert status == 201, snap
        assert (await s.call("GET", f"/sandboxes/{sid}"))[1]["state"] == "running"  # the source runs on
        status, child = await s.call("POST", "/sandboxes", {"templateID": "files-only", "timeout": 120})
        assert status == 201, child
        assert await read_file(s, child["sandboxID"], child["envdAccessToken"], "/home/user/kept.txt") == b"files only"

        status, forks = await s.call("POST", f"/v2/sandboxes/{sid}/fork", {"count": 3, "memory": False})
        assert status == 201 and len(forks) == 3 and all("sandbox" in f for f in forks), forks
        for i, f in enumerate(forks):
            fid, ftoken = f["sandbox"]["sandboxID"], f["sandbox"]["envdAccessToken"]
            assert await read_file(s, fid, ftoken, "/home/user/kept.txt") == b"files only"
            await write_file(s, fid, ftoken, "/home/user/mine.txt", str(i).encode())
        for i, f in enumerate(forks):  # each diverges
            assert await read_file(s, f["sandbox"]["sandboxID"], f["sandbox"]["envdAccessToken"],
                                   "/home/user/mine.txt") == str(i).encode()
        assert s.runtime.calls.get("create", 0) - boots == 4  # the snapshot's child and three forks: cold boots
        assert s.runtime.calls.get("restore", 0) == restores  # nothing restored from memory
