"""E2B volumes end to end: the stock SDK's Volume API and volume_mounts against a real server of our own (it is
restarted in the middle) and real gVisor sandboxes; the error cases also over raw HTTP, to pin the JSON.

Imports no keepstate code. SDK releases without volumes (e2b 2.45, 2.50) skip with the reason.
"""

from __future__ import annotations

import os
import tempfile
import threading
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sdkharness import Server, make_key, pause_files, start_server

try:
    from e2b import Volume
except ImportError:  # older SDK releases
    Volume = None

pytestmark = pytest.mark.skipif(Volume is None, reason="this e2b SDK release has no Volume API (added after 2.50)")
# No standbys: a resume is then a real restore of the checkpoint, which must get the volume mounted again.
EXTRA = ("--reap-on-exit", "--standby-seconds", "0")
ENV = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_VOLUME_API_URL")


@pytest.fixture(scope="module")
def own(e2b_env: None) -> Iterator[dict[str, Any]]:
    """A server of this module's own (the test restarts it), and the SDK pointed at it, volumes included."""
    home = tempfile.mkdtemp(prefix="keepstate-volumes-")
    srv = start_server(home, pool=1, extra=EXTRA)
    srv.key = make_key(home)
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update({"E2B_API_URL": srv.url, "E2B_SANDBOX_URL": srv.url, "E2B_API_KEY": srv.key,
                       "E2B_VOLUME_API_URL": srv.url})
    state: dict[str, Any] = {"server": srv, "home": home}
    try:
        yield state
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc = state["server"].proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)


def api(srv: Server) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"X-API-KEY": srv.key}, timeout=60)


def content(srv: Server, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.Client(base_url=srv.url, headers=headers, timeout=60)


def json_error(r: httpx.Response, status: int, words: str) -> None:
    """An error in the one JSON shape, with a message that says what happened."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert body["code"] == status and isinstance(body["message"], str), body
    assert words.lower() in body["message"].lower(), body


def restart(state: dict[str, Any]) -> Server:
    old: Server = state["server"]
    assert old.proc is not None
    old.proc.terminate()  # a clean stop with --reap-on-exit: its sandboxes go, the volumes are unmounted
    old.proc.wait(timeout=120)
    port = urllib.parse.urlparse(old.url).port
    srv = start_server(state["home"], port=port, pool=1, extra=EXTRA)
    srv.key = old.key
    state["server"] = srv
    return srv


def test_a_volume_outlives_two_sandboxes_and_a_restart(own: dict[str, Any]) -> None:
    from e2b import Sandbox, VolumeNotFoundException

    srv: Server = own["server"]
    name = f"shared-{uuid.uuid4().hex[:8]}"
    vol = Volume.create(name)
    assert vol.name == name and vol.token
    vol.write_file("/x", "from the content API")
    with api(srv) as c:  # ours: a small quota, to fill from inside a sandbox
        r = c.post("/volumes", json={"name": f"small-{uuid.uuid4().hex[:8]}", "sizeMB": 16})
        assert r.status_code == 201, r.text
        small = r.json()

    one = Sandbox.create(timeout=300, volume_mounts={"/mnt/data": vol, "/mnt/small": small["name"]})
    two = Sandbox.create(timeout=300, volume_mounts={"/mnt/data": name})
    try:
        assert one.commands.run("cat /mnt/data/x").stdout == "from the content API"
        one.commands.run("echo -n one > /mnt/data/from-one")
        assert two.commands.run("cat /mnt/data/from-one").stdout == "one"
        two.commands.run("mkdir -p /mnt/data/dir && echo -n two > /mnt/data/dir/from-two")
        assert one.commands.run("cat /mnt/data/dir/from-two").stdout == "two"
        assert vol.read_file("/dir/from-two") == "two"  # the content API sees a sandbox's write at once
        vol.write_file("/from-one", "overwritten by the API", force=True)
        assert two.commands.run("cat /mnt/data/from-one").stdout == "overwritten by the API"
        names = {e.name for e in vol.list("/")}
        assert {"x", "from-one", "dir"} <= names
        # A sandbox that fills its volume gets ENOSPC, as from a full disk.
        full = one.commands.run("dd if=/dev/zero of=/mnt/small/fill bs=1M count=32 2>&1 || true")
        assert "No space left" in full.stdout, full.stdout
        # info and list echo the mounts
        info = Sandbox.get_info(one.sandbox_id)
        assert sorted(info.volume_mounts, key=lambda m: m["path"]) == [
            {"name": name, "path": "/mnt/data"}, {"name": small["name"], "path": "/mnt/small"}]
        listed = {s.sandbox_id: s for s in Sandbox.list().next_items()}
        assert listed[two.sandbox_id].volume_mounts == [{"name": name, "path": "/mnt/data"}]
        # A symlink a sandbox leaves pointing out of the volume is not followed by the (root) server.
        one.commands.run("ln -s /etc /mnt/data/etc-link")
        with content(srv, vol.token) as c:
            json_error(c.get(f"/volumecontent/{vol.volume_id}/file", params={"path": "/etc-link/passwd"}), 400,
                       "out of the volume")
        # A mounted volume cannot be destroyed: the answer names the sandbox.
        with api(srv) as c:
            r = c.delete(f"/volumes/{vol.volume_id}")
            json_error(r, 409, "mounted by sandbox")
            assert one.sandbox_id in r.json()["message"] or two.sandbox_id in r.json()["message"]
    finally:
        one.kill()
        two.kill()

    srv = restart(own)
    again = Volume.connect(vol.volume_id)
    assert again.read_file("/x") == "from the content API"
    assert again.read_file("/dir/from-two") == "two"
    assert {v.volume_id for v in Volume.list()} >= {vol.volume_id, small["volumeID"]}
    three = Sandbox.create(timeout=120, volume_mounts={"/home/user/data": again})
    try:  # mounted again after the restart, for sandboxes too
        assert three.commands.run("cat /home/user/data/from-one").stdout == "overwritten by the API"
    finally:
        three.kill()
    with api(srv) as c:
        assert c.delete(f"/volumes/{small['volumeID']}").status_code == 204
    assert Volume.destroy(vol.volume_id) is True
    with pytest.raises(VolumeNotFoundException):
        Volume.get_info(vol.volume_id)
    assert Volume.destroy(vol.volume_id) is False
    with content(srv, vol.token) as c:
        json_error(c.get(f"/volumecontent/{vol.volume_id}/path", params={"path": "/x"}), 404, "not found")


def test_content_api_errors_are_clear_json(own: dict[str, Any]) -> None:
    from e2b import AuthenticationException, Sandbox

    srv: Server = own["server"]
    with api(srv) as c:
        r = c.post("/volumes", json={"name": f"errs-{uuid.uuid4().hex[:8]}", "sizeMB": 16})
        assert r.status_code == 201, r.text
        info = r.json()
        json_error(c.post("/volumes", json={"name": info["name"]}), 409, "exists")
        json_error(c.post("/volumes", json={"name": "../etc"}), 400, "name")
        json_error(c.get("/volumes/volnotthere"), 404, "not found")
    vid, token = info["volumeID"], info["token"]
    base = f"/volumecontent/{vid}"
    with content(srv, token) as c:
        json_error(c.get(f"{base}/file", params={"path": "/../../etc/passwd"}), 400, "..")
        json_error(c.get(f"{base}/file", params={"path": "a/../../b"}), 400, "traversal")
        json_error(c.get(f"{base}/file"), 400, "path")
        json_error(c.get(f"{base}/file", params={"path": "/missing"}), 404, "not found")
        json_error(c.get(f"{base}/dir", params={"path": "/", "depth": "x"}), 400, "depth")
        assert c.post(f"{base}/dir", params={"path": "/d"}).status_code == 201
        json_error(c.post(f"{base}/dir", params={"path": "/d"}), 409, "exists")
        assert c.post(f"{base}/dir", params={"path": "/d", "force": "true"}).status_code == 201
        assert c.put(f"{base}/file", params={"path": "/d/f"}, content=b"1").status_code == 201
        json_error(c.put(f"{base}/file", params={"path": "/d/f"}, content=b"2"), 409, "force")
        json_error(c.get(f"{base}/file", params={"path": "/d"}), 400, "directory")
        # oversized: told in advance (Content-Length) and streamed without a length
        json_error(c.put(f"{base}/file", params={"path": "/big"}, content=b"x" * (20 << 20)), 413, "free space")

        def chunks() -> Iterator[bytes]:
            for _ in range(80):
                yield b"y" * (256 << 10)

        json_error(c.put(f"{base}/file", params={"path": "/big"}, content=chunks()), 413, "full")
        r = c.get(f"{base}/dir", params={"path": "/"})
        assert r.status_code == 200 and [e["path"] for e in r.json()] == ["/d"]  # no partial upload left
        json_error(c.get("/volumecontent/volnotthere/path", params={"path": "/"}), 404, "not found")
    for bad in (None, "wrong"):
        with content(srv, bad) as c:
            json_error(c.get(f"{base}/path", params={"path": "/"}), 401, "token")
    for header in ("Bearer", f"Basic {token}"):
        with httpx.Client(base_url=srv.url, headers={"Authorization": header}) as c:
            json_error(c.get(f"{base}/path", params={"path": "/"}), 401, "token")
    with httpx.Client(base_url=srv.url, headers={"X-API-KEY": srv.key}) as c:  # the API key is not a token
        json_error(c.get(f"{base}/path", params={"path": "/"}), 401, "token")
    with pytest.raises(AuthenticationException):
        Volume(vid, info["name"], token="vol_wrong").read_file("/d/f")
    assert Volume(vid, info["name"], token=token).read_file("/d/f") == "1"
    with api(srv) as c:  # mounts naming no volume, or a bad path, are refused before anything starts
        json_error(c.post("/sandboxes", json={"templateID": "base", "volumeMounts": [
            {"name": "no-such-volume", "path": "/mnt/x"}]}), 400, "not found")
        json_error(c.post("/sandboxes", json={"templateID": "base", "volumeMounts": [
            {"name": info["name"], "path": "/proc/x"}]}), 400, "/proc")
    with pytest.raises(Exception, match="not found"):
        Sandbox.create(timeout=60, volume_mounts={"/mnt/x": "no-such-volume"})
    with api(srv) as c:
        assert c.delete(f"/volumes/{vid}").status_code == 204


def test_racing_creates_and_a_write_racing_a_destroy(own: dict[str, Any]) -> None:
    srv: Server = own["server"]
    name = f"race-{uuid.uuid4().hex[:8]}"
    statuses: list[int] = []

    def create() -> None:
        with api(srv) as c:
            statuses.append(c.post("/volumes", json={"name": name, "sizeMB": 16}).status_code)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(statuses) == [201, 409, 409, 409]
    with api(srv) as c:
        vol = next(v for v in c.get("/volumes").json() if v["name"] == name)
        token = c.get(f"/volumes/{vol['volumeID']}").json()["token"]
    base = f"/volumecontent/{vol['volumeID']}"
    results: dict[str, int] = {}

    def write() -> None:
        def slow() -> Iterator[bytes]:
            for _ in range(40):
                yield b"z" * (64 << 10)

        with content(srv, token) as c:
            results["write"] = c.put(f"{base}/file", params={"path": "/w"}, content=slow()).status_code

    def destroy() -> None:
        with api(srv) as c:
            results["delete"] = c.delete(f"/volumes/{vol['volumeID']}").status_code

    w, d = threading.Thread(target=write), threading.Thread(target=destroy)
    w.start()
    d.start()
    w.join()
    d.join()
    # Either order is fine; what may not happen is a 5xx or a volume left half there.
    assert results["delete"] == 204 and results["write"] in (201, 404), results
    with api(srv) as c:
        json_error(c.get(f"/volumes/{vol['volumeID']}"), 404, "not found")
        assert name not in {v["name"] for v in c.get("/volumes").json()}


def test_checkpoints_hold_no_volume_data_and_forks_share_the_volume(own: dict[str, Any]) -> None:
    """A pause, and the checkpoint a fork is made from, keep the sandbox's memory and root filesystem, not the
    volume: what is written to the volume meanwhile is what the resumed sandbox and the forks see; a fork mounts
    the same volume (shared, not copied)."""
    from e2b import Sandbox

    vol = Volume.create(f"ckpt-{uuid.uuid4().hex[:8]}")
    vol.write_file("/state", "before")
    sbx = Sandbox.create(timeout=300, volume_mounts={"/mnt/v": vol})
    forks: list[Any] = []
    try:
        sbx.commands.run("echo -n root-before > /home/user/root-file")
        assert sbx.pause() is True
        vol.write_file("/state", "written while paused", force=True)
        sbx = Sandbox.connect(sbx.sandbox_id, timeout=300)  # restored from its checkpoint, volume mounted again
        assert sbx.commands.run("cat /mnt/v/state").stdout == "written while paused"
        assert sbx.commands.run("cat /home/user/root-file").stdout == "root-before"  # in the checkpoint
        assert Sandbox.get_info(sbx.sandbox_id).volume_mounts == [{"name": vol.name, "path": "/mnt/v"}]
        forks = sbx.fork(count=1, timeout=120)
        fork = forks[0]
        assert not isinstance(fork, Exception), fork
        assert Sandbox.get_info(fork.sandbox_id).volume_mounts == [{"name": vol.name, "path": "/mnt/v"}]
        fork.commands.run("echo -n from-the-fork > /mnt/v/fork-file")
        assert sbx.commands.run("cat /mnt/v/fork-file").stdout == "from-the-fork"
        assert vol.read_file("/fork-file") == "from-the-fork"
        fork.commands.run("echo -n fork-root > /home/user/root-file")  # its root filesystem is its own
        assert sbx.commands.run("cat /home/user/root-file").stdout == "root-before"
    finally:
        for f in forks:
            if not isinstance(f, Exception):
                f.kill()
        sbx.kill()
    assert Volume.destroy(vol.volume_id) is True


def test_a_filesystem_only_pause_keeps_the_sandbox_files_and_mounts_the_volume_again(own: dict[str, Any]) -> None:
    """The cold boot that resumes a filesystem-only pause mounts the same volume; the pause kept the sandbox's own
    files, not the volume's (its mount point is skipped)."""
    from e2b import Sandbox

    vol = Volume.create(f"fs-{uuid.uuid4().hex[:8]}")
    sbx = Sandbox.create(timeout=300, volume_mounts={"/home/user/shared": vol})
    try:
        sbx.commands.run("echo -n mine > /home/user/own && echo -n theirs > /home/user/shared/in-volume")
        assert pause_files(sbx) is True
        vol.write_file("/while-paused", "new", force=True)
        sbx = Sandbox.connect(sbx.sandbox_id, timeout=300)
        assert sbx.commands.run("cat /home/user/own").stdout == "mine"
        listing = sbx.commands.run("ls /home/user/shared").stdout.split()
        assert sorted(listing) == ["in-volume", "while-paused"]
        # nothing of it leaked into the template: another sandbox has no such directory
        other = Sandbox.create(timeout=60)
        try:
            assert other.commands.run("test ! -e /home/user/shared && echo clean").stdout.strip() == "clean"
        finally:
            other.kill()
    finally:
        sbx.kill()
    assert Volume.destroy(vol.volume_id) is True
