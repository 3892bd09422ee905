"""A sandbox's disk (its writable layer, docs/design/sandbox-disk.md) and filesystem-only pause, with the stock SDK.

Sizes a create cannot ask for through the SDK (`memoryMB`, `diskSizeMB`: our extensions) are asked for with one raw
create; everything after it is the SDK's.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from e2b import Sandbox
from e2b.sandbox.commands.command_handle import CommandExitException

from sdkharness import Server, has_snapshot_modes, pause_files, start_marker, survived


def raw(server: Server, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server.url + path, data=data, method=method,
                                 headers={"X-API-Key": server.key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read()
            return r.status, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def create_sized(server: Server, **sizes: int) -> Sandbox:
    status, body = raw(server, "POST", "/sandboxes", {"templateID": "base", "timeout": 300, **sizes})
    assert status == 201, body
    return Sandbox.connect(body["sandboxID"])


def zeros_md5(n: int) -> str:
    h = hashlib.md5()
    block = bytes(1 << 20)
    while n:
        take = min(n, len(block))
        h.update(block[:take])
        n -= take
    return h.hexdigest()


def test_a_file_larger_than_the_sandbox_memory_is_written_and_read_back(server: Server) -> None:
    sbx = create_sized(server, memoryMB=256)
    try:
        size = 400 << 20
        r = sbx.commands.run(f"head -c {size} /dev/zero > /home/user/big && md5sum /home/user/big", timeout=180)
        assert r.stdout.split()[0] == zeros_md5(size)
        # written out, the pages are reclaimable: the sandbox (256 MiB) lives on, and reads it back
        assert sbx.commands.run("md5sum /home/user/big", timeout=120).stdout.split()[0] == zeros_md5(size)
        assert sbx.is_running()
    finally:
        sbx.kill()


def test_a_write_beyond_the_disk_quota_is_enospc_and_the_sandbox_lives_on(server: Server) -> None:
    sbx = create_sized(server, diskSizeMB=300)
    try:
        assert Sandbox.get_info(sbx.sandbox_id) is not None
        status, info = raw(server, "GET", f"/sandboxes/{sbx.sandbox_id}")
        assert status == 200 and info["diskSizeMB"] == 300
        bg = sbx.commands.run("sleep 600", background=True)
        with pytest.raises(CommandExitException) as full:
            sbx.commands.run("head -c 400000000 /dev/zero > /home/user/fill", timeout=180)
        assert full.value.exit_code != 0 and "No space left on device" in full.value.stderr
        # the writer got the error; every other process, and the sandbox, are fine
        assert any(p.pid == bg.pid for p in sbx.commands.list())
        sbx.commands.run("rm /home/user/fill")
        sbx.files.write("/home/user/after.txt", "room again")
        assert sbx.files.read("/home/user/after.txt") == "room again"
    finally:
        sbx.kill()


def test_disk_size_is_checked(server: Server) -> None:
    for bad in (0, 10, "big", 1.5, 1 << 30):
        status, body = raw(server, "POST", "/sandboxes", {"templateID": "base", "diskSizeMB": bad})
        assert status == 400 and "diskSizeMB" in body["message"], (bad, body)


def test_filesystem_pause_keeps_files_and_cold_boots(server: Server) -> None:
    sbx = Sandbox.create(timeout=300, metadata={"who": "fs-pause"})
    sbx.files.write("/home/user/notes/a.txt", "kept across a cold boot")
    sbx.commands.run("head -c 3000000 /dev/urandom > /home/user/blob && ln -s notes/a.txt /home/user/link && "
                     "chmod 640 /home/user/notes/a.txt && rm /home/user/.bashrc")
    sbx.commands.run("sudo sh -c 'rm /etc/motd; echo changed > /etc/issue'")
    blob = sbx.commands.run("md5sum /home/user/blob").stdout.split()[0]
    before = start_marker(sbx)
    sbx.commands.run("sleep 600", background=True)

    assert pause_files(sbx) is True
    status, info = raw(server, "GET", f"/sandboxes/{sbx.sandbox_id}")
    assert status == 200 and info["state"] == "paused" and info["pauseMode"] == "filesystem"
    assert pause_files(sbx) is False  # already paused (the SDK maps the 409)

    again = Sandbox.connect(sbx.sandbox_id)
    try:
        assert again.sandbox_id == sbx.sandbox_id
        assert not survived(again, before)  # a new boot
        assert again.files.read("/home/user/notes/a.txt") == "kept across a cold boot"
        assert again.commands.run("md5sum /home/user/blob").stdout.split()[0] == blob
        assert again.commands.run("readlink /home/user/link").stdout.strip() == "notes/a.txt"
        assert again.commands.run("stat -c %a /home/user/notes/a.txt").stdout.strip() == "640"
        gone = again.commands.run("test ! -e /home/user/.bashrc && test ! -e /etc/motd && cat /etc/issue")
        assert gone.stdout.strip() == "changed"
        assert "sleep 600" not in again.commands.run("ps -eo args").stdout  # no process survives a cold boot
        # the same envd token: the SDK object from before the pause still works
        assert sbx.commands.run("echo same token").stdout.strip() == "same token"
        assert Sandbox.get_info(sbx.sandbox_id).metadata == {"who": "fs-pause"}
        status, info = raw(server, "GET", f"/sandboxes/{sbx.sandbox_id}")
        assert info["state"] == "running" and "pauseMode" not in info
    finally:
        again.kill()


def test_concurrent_connects_of_a_sandbox_paused_with_memory_resume_it_once(server: Server) -> None:
    """Two reboots (on_resume="reboot": its files taken out of its memory image, then a new boot) and a restore
    at once: one of them resumes it, the others find it running (a no-op connect, as E2B documents)."""
    sbx = Sandbox.create(timeout=300)
    try:
        sbx.files.write("/home/user/kept.txt", "kept")
        sbx.pause()
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda how: Sandbox.connect(sbx.sandbox_id, on_resume=how),
                                ["reboot", "reboot", "restore"]))
        assert {g.sandbox_id for g in got} == {sbx.sandbox_id}
        assert got[0].files.read("/home/user/kept.txt") == "kept"
        status, history = raw(server, "GET", f"/sandboxes/{sbx.sandbox_id}/events?verify=true")
        assert status == 200 and history["verified"]["ok"] is True
        assert [e["kind"] for e in history["events"]].count("sandbox.resume") == 1
        boot = got[0].files.read("/proc/sys/kernel/random/boot_id")
        assert Sandbox.connect(sbx.sandbox_id, on_resume="reboot").files.read(
            "/proc/sys/kernel/random/boot_id") == boot  # running: reboot is a no-op
    finally:
        Sandbox.kill(sbx.sandbox_id)


def test_concurrent_pauses_of_both_kinds_one_wins(server: Server) -> None:
    sbx = Sandbox.create(timeout=300)
    sbx.files.write("/home/user/x.txt", "x")
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            calls = [pool.submit(raw, server, "POST", f"/sandboxes/{sbx.sandbox_id}/pause", {"memory": m})
                     for m in (False, True, False, True)]
            results = [c.result() for c in calls]
        codes = sorted(s for s, _ in results)
        assert codes.count(204) == 1 and all(c == 409 for c in codes if c != 204), results
        assert all(b["code"] == 409 and b["message"] for s, b in results if s == 409)
        assert Sandbox.connect(sbx.sandbox_id).files.read("/home/user/x.txt") == "x"
    finally:
        Sandbox.kill(sbx.sandbox_id)


def test_auto_pause_on_timeout_keeps_files_only_when_asked(server: Server) -> None:
    if not has_snapshot_modes(Sandbox):
        pytest.skip("this SDK release has no snapshot modes: its lifecycle cannot ask for a filesystem-only pause")
    try:
        sbx = Sandbox.create(timeout=2, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    except (TypeError, ValueError, AttributeError) as exc:
        pytest.skip(f"this SDK release has no filesystem mode for lifecycle: {exc}")
    try:
        sbx.files.write("/home/user/kept.txt", "kept")
        deadline = time.monotonic() + 60
        while raw(server, "GET", f"/sandboxes/{sbx.sandbox_id}")[1]["state"] != "paused":
            assert time.monotonic() < deadline, "the sandbox was not paused at its timeout"
            time.sleep(0.5)
        assert raw(server, "GET", f"/sandboxes/{sbx.sandbox_id}")[1]["pauseMode"] == "filesystem"
        assert Sandbox.connect(sbx.sandbox_id, timeout=120).files.read("/home/user/kept.txt") == "kept"
    finally:
        Sandbox.kill(sbx.sandbox_id)
