"""Crashes, lost hosts, corrupt stores and incompatible hosts: the session survives or is refused clearly."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException

from keepstate.store import LocalBackend
from keepstate.store.lock import read_locks
from tests.sdk.sdkharness import KEEPSTATE, wait_until

from .conftest import Fleet, keepstate_env, sdk_opts, store_path


def counting(sbx: Sandbox) -> None:
    sbx.commands.run("nohup python3 -c 'import time\ni=0\nwhile True:\n  i+=1\n  open(\"/tmp/c\",\"w\").write(str(i))"
                     "\n  time.sleep(0.05)' >/dev/null 2>&1 &")
    wait_until(lambda: sbx.files.exists("/tmp/c"), 20, "the counter in the sandbox to write /tmp/c")


def count(sbx: Sandbox) -> int:
    for _ in range(50):  # the writer truncates then writes: an empty read is "in between"
        text = sbx.files.read("/tmp/c").strip()
        if text:
            return int(text)
        time.sleep(0.02)
    raise AssertionError("/tmp/c stayed empty")


def ks(srv, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(KEEPSTATE), *args], env=keepstate_env(srv), capture_output=True, text=True,
                          timeout=300)


def history(srv, sandbox_id: str) -> list[dict]:
    events = json.loads(ks(srv, "events", sandbox_id, "--json").stdout)
    return events["events"] if isinstance(events, dict) else events


def resumed_from(srv, sandbox_id: str) -> list[str]:
    """Where each resume of the session came from: "standby" (a thaw) or "store" (a restore)."""
    return [e["data"]["from"] for e in history(srv, sandbox_id) if e["kind"] == "sandbox.resume"]


def command_recorded(srv, sandbox_id: str, command: str) -> bool:
    """Whether the session's history holds both the start and the exit of `command` (pulled from the journal)."""
    events = history(srv, sandbox_id)
    pids = {e["data"]["pid"] for e in events if e["kind"] == "process.start"
            and e["data"].get("args", [])[-1:] == [command]}
    return any(e["kind"] == "process.exit" and e["data"]["pid"] in pids for e in events)


def standby_of(srv, sandbox_id: str) -> bool:
    """Whether the database still records a frozen instance (standby, or one being released) for the sandbox."""
    db = sqlite3.connect(f"file:{Path(srv.home) / 'keepstate.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        (doc,) = db.execute("SELECT doc FROM sandboxes WHERE sandbox_id=?", (sandbox_id,)).fetchone()
    finally:
        db.close()
    data = json.loads(doc)
    return "standby" in data or "retired" in data


@pytest.mark.parametrize("standby", [("standby", ()), ("store", ("--standby-mb", "0"))], ids=["thaw", "restore"])
def test_sigkill_between_pause_and_resume(fleet: Fleet, standby: tuple[str, tuple[str, ...]]) -> None:
    """With standbys on, the frozen instance outlives the server and the next one thaws it; with no room for
    standbys (--standby-mb 0) it is released right after the pause and the resume restores from the store."""
    source, extra = standby
    srv = fleet.start(extra=extra)
    sbx = Sandbox.create(timeout=300, **sdk_opts(srv))
    counting(sbx)
    sbx.files.write("/home/user/f.txt", "kept")
    before = count(sbx)
    sbx.pause()
    if source == "store":  # over budget: the standby is released within a moment; wait until it is gone
        wait_until(lambda: not standby_of(srv, sbx.sandbox_id), 60, "the standby to be released (--standby-mb 0)")
    else:
        assert standby_of(srv, sbx.sandbox_id)
    port = int(srv.url.rsplit(":", 1)[1])
    fleet.sigkill(srv)

    srv2 = fleet.start(home=srv.home, port=port, extra=extra)
    opts = sdk_opts(srv2)
    resumed = Sandbox.connect(sbx.sandbox_id, **opts)
    assert resumed.files.read("/home/user/f.txt") == "kept"
    paused_at = count(resumed)
    assert paused_at >= before
    # the same process, still counting
    wait_until(lambda: count(resumed) > paused_at, 30, f"the resumed counter to go on past {paused_at}")
    assert resumed_from(srv2, sbx.sandbox_id) == [source]
    resumed.kill()


def test_resume_on_a_second_server_sharing_only_the_s3_store(fleet: Fleet, s3_server) -> None:
    store = s3_server.url(f"portable-{time.time_ns()}")
    a = fleet.start(store=store)
    sbx = Sandbox.create(timeout=300, **sdk_opts(a))
    counting(sbx)
    sbx.files.write("/home/user/travels.txt", "across hosts")
    before = count(sbx)
    sbx.pause()
    fleet.sigkill(a)
    shutil.rmtree(a.home)  # the first host's data directory is lost

    b = fleet.start(store=store)
    resumed = Sandbox.connect(sbx.sandbox_id, **sdk_opts(b))
    assert resumed.sandbox_id == sbx.sandbox_id
    assert resumed.files.read("/home/user/travels.txt") == "across hosts"
    assert count(resumed) >= before
    resumed.kill()


def test_a_pause_the_store_refuses_leaves_the_sandbox_running(fleet: Fleet) -> None:
    """A pause freezes the sandbox before the checkpoint; if the store then fails, it is thawed, not left frozen."""
    srv = fleet.start()
    opts = sdk_opts(srv)
    sbx = Sandbox.create(timeout=300, **opts)
    counting(sbx)
    packs = store_path(srv) / "packs"
    shutil.rmtree(packs, ignore_errors=True)
    packs.write_text("a file where the store keeps its packs: every pack write fails")
    with pytest.raises(SandboxException):
        sbx.pause()
    assert Sandbox.get_info(sbx.sandbox_id, **opts).state.value == "running"
    before = count(sbx)
    # it runs on, from where the pause froze it
    wait_until(lambda: count(sbx) > before, 30, f"the thawed counter to go on past {before}")
    packs.unlink()
    sbx.pause()  # the store works again: so does the pause
    assert count(Sandbox.connect(sbx.sandbox_id, **opts)) >= before


def test_flipped_byte_in_any_object_refuses_restore_and_verify_finds_it(fleet: Fleet) -> None:
    srv = fleet.start(extra=("--standby-seconds", "0"))  # no standby: a resume must restore from the store
    sbx = Sandbox.create(timeout=300, **sdk_opts(srv))
    sbx.files.write("/home/user/x.txt", "x")
    sbx.pause()
    ls = json.loads(ks(srv, "checkpoint", "ls", "--json").stdout)
    checkpoint_id = [c["checkpoint_id"] for c in ls if c["session_id"] == sbx.sandbox_id][-1]
    packs = sorted(p for p in store_path(srv).rglob("*") if p.is_file() and "pack" in str(p))
    assert packs, list(store_path(srv).rglob("*"))
    victim = max(packs, key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))

    with pytest.raises(SandboxException) as err:
        Sandbox.connect(sbx.sandbox_id, **sdk_opts(srv))
    message = str(err.value)
    assert checkpoint_id in message and ("pack" in message or "chunk" in message)
    # nothing was restored: the sandbox is still paused, not half-running
    assert Sandbox.get_info(sbx.sandbox_id, **sdk_opts(srv)).state.value == "paused"
    verify = ks(srv, "store", "verify")
    assert verify.returncode != 0
    assert victim.name in verify.stdout + verify.stderr or "pack" in (verify.stdout + verify.stderr)


def test_sigkill_during_checkpoint_then_gc(fleet: Fleet) -> None:
    srv = fleet.start()
    opts = sdk_opts(srv)
    sbx = Sandbox.create(timeout=600, **opts)
    sbx.files.write("/home/user/v.txt", "v1")
    sbx.pause()
    Sandbox.connect(sbx.sandbox_id, **opts)  # a first checkpoint exists now
    first = {c["checkpoint_id"] for c in json.loads(ks(srv, "checkpoint", "ls", "--json").stdout)}
    # make the next ingest take a while: 256 MiB of fresh random memory
    sbx.commands.run("python3 -c \"import os,time; b=os.urandom(256<<20); open('/tmp/ready','w').write('1'); "
                     "time.sleep(3600)\" >/dev/null 2>&1 &")
    wait_until(lambda: sbx.files.exists("/tmp/ready"), 120, "the sandbox to hold 256 MiB of fresh memory",
               every=0.2)
    store = LocalBackend(store_path(srv))
    packs_before = {o.key for o in store.list("packs/")}
    pausing = threading.Thread(target=lambda: _ignore(lambda: Sandbox.pause(sbx.sandbox_id, **opts)))
    pausing.start()

    def ingesting() -> bool:
        """runsc has checkpointed and the store is ingesting: the write holds its lock and has stored new packs."""
        assert pausing.is_alive(), "the pause ended before the test saw it ingest: nothing left to kill it in"
        writing = any(lock.purpose.startswith("write checkpoint") for lock in read_locks(store))
        return writing and bool({o.key for o in store.list("packs/")} - packs_before)

    wait_until(ingesting, 120, "the pause's ingest to be under way (write lock held, new packs stored)", every=0.02)
    port = int(srv.url.rsplit(":", 1)[1])
    fleet.sigkill(srv)
    pausing.join()

    srv2 = fleet.start(home=srv.home, port=port)
    after = {c["checkpoint_id"] for c in json.loads(ks(srv2, "checkpoint", "ls", "--json").stdout)}
    assert after == first  # no partial checkpoint is listed
    # the sandbox was never lost: it is still running (a pause publishes before it stops anything)
    again = Sandbox.connect(sbx.sandbox_id, **sdk_opts(srv2))
    assert again.files.read("/home/user/v.txt") == "v1"
    gc = ks(srv2, "store", "gc", "--json")
    assert gc.returncode == 0, gc.stderr
    assert ks(srv2, "store", "verify").returncode == 0


def _ignore(fn) -> None:
    try:
        fn()
    except Exception:
        pass


def test_restore_refused_when_template_build_differs(fleet: Fleet, tmp_path: Path) -> None:
    store = f"file://{tmp_path / 'shared-store'}"
    a = fleet.start(store=store)
    sbx = Sandbox.create(timeout=300, **sdk_opts(a))
    sbx.pause()
    fleet.sigkill(a)
    # a host whose `base` build is a different one: same definition, another root filesystem digest
    cache = tmp_path / "other-templates"
    real = Path("/var/lib/keepstate/templates/base/current").resolve()
    fake = cache / "base" / real.name
    fake.mkdir(parents=True)
    (fake / "rootfs").symlink_to(real / "rootfs")
    info = json.loads((real / "build.json").read_text())
    info["digest"] = "0" * 64
    (fake / "build.json").write_text(json.dumps(info))
    (cache / "base" / "current").symlink_to(real.name)
    b = fleet.start(store=store, cache=str(cache))
    with pytest.raises(SandboxException) as err:
        Sandbox.connect(sbx.sandbox_id, **sdk_opts(b))
    assert "template digest" in str(err.value)


def test_edited_event_fails_verification(fleet: Fleet) -> None:
    srv = fleet.start()
    sbx = Sandbox.create(timeout=300, **sdk_opts(srv))
    sbx.commands.run("echo history")
    wait_until(lambda: command_recorded(srv, sbx.sandbox_id, "echo history"), 30,
               "the server to pull the command's start and exit from the agent's journal")
    ok = ks(srv, "events", sbx.sandbox_id, "--verify")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    db = sqlite3.connect(Path(srv.home) / "keepstate.sqlite", timeout=10)  # the history is in the one database
    assert db.execute("UPDATE events SET kind='tampered' WHERE session_id=? AND seq=1",
                      (sbx.sandbox_id,)).rowcount == 1
    db.commit()
    db.close()
    bad = ks(srv, "events", sbx.sandbox_id, "--verify")
    assert bad.returncode == 1
    assert "1" in bad.stdout + bad.stderr
    sbx.kill()


def test_exported_checkpoint_resumes_on_another_server(fleet: Fleet, tmp_path: Path) -> None:
    a = fleet.start()
    sbx = Sandbox.create(timeout=300, **sdk_opts(a))
    counting(sbx)
    sbx.files.write("/home/user/moved.txt", "by archive")
    sbx.pause()
    ls = json.loads(ks(a, "checkpoint", "ls", "--json").stdout)
    checkpoint_id = [c["checkpoint_id"] for c in ls if c["session_id"] == sbx.sandbox_id][-1]
    archive = tmp_path / "session.kscp"
    out = ks(a, "checkpoint", "export", checkpoint_id, str(archive), "-q")
    assert out.returncode == 0, out.stderr
    fleet.sigkill(a)
    shutil.rmtree(a.home)

    b = fleet.start()  # another data directory, another (empty) store
    imp = ks(b, "checkpoint", "import", str(archive), "-q")
    assert imp.returncode == 0, imp.stderr
    assert ks(b, "checkpoint", "verify", checkpoint_id).returncode == 0
    resumed = Sandbox.connect(sbx.sandbox_id, **sdk_opts(b))
    assert resumed.files.read("/home/user/moved.txt") == "by archive"
    before = count(resumed)
    wait_until(lambda: count(resumed) > before, 30, f"the imported session's counter to go on past {before}")
    resumed.kill()
