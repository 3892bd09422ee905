"""Durable sessions through the stock SDK: pause/resume, snapshots, fork, lineage, history."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from e2b import Sandbox, SandboxState

from sdkharness import wait_until

# A process whose state lives in memory: a counter, an open file and a listening socket.
STATEFUL = r"""
import socket, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 7000)); srv.listen(); srv.settimeout(0.05)
log = open("/tmp/log.txt", "a")
n = 0
while True:
    n += 1
    log.write(f"{n}\n"); log.flush()
    with open("/tmp/count", "w") as f:
        f.write(str(n))
    try:
        conn, _ = srv.accept()
        conn.sendall(f"count={n}\n".encode()); conn.close()
    except socket.timeout:
        pass
    time.sleep(0.05)
"""


def start_stateful(sbx) -> int:
    sbx.files.write("/home/user/stateful.py", STATEFUL)
    sbx.files.write("/home/user/notes.txt", "written before the pause")
    handle = sbx.commands.run("python3 /home/user/stateful.py", background=True)
    wait_until(lambda: sbx.files.exists("/tmp/count") and int(sbx.files.read("/tmp/count") or 0) > 3, 20,
               "the stateful process to count past 3 in /tmp/count")
    return handle.pid


def counter(sbx) -> int:
    # the writer truncates then writes: an empty read means "in between", so read again
    for _ in range(50):
        text = sbx.files.read("/tmp/count").strip()
        if text:
            return int(text)
        time.sleep(0.02)
    raise AssertionError("/tmp/count stayed empty")


def ask_socket(sbx) -> str:
    script = "import socket; s=socket.create_connection(('127.0.0.1',7000)); print(s.recv(64).decode().strip())"
    return sbx.commands.run(f"python3 -c \"{script}\"").stdout.strip()


def api(server, path: str) -> object:
    req = urllib.request.Request(server.url + path, headers={"X-API-KEY": server.key})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=30) as r:
        return json.loads(r.read())


def test_pause_resume_keeps_processes_memory_and_files(new_sandbox) -> None:
    sbx = new_sandbox(timeout=300)
    pid = start_stateful(sbx)
    before = counter(sbx)
    assert sbx.pause() is True
    assert sbx.is_running() is False
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
    assert sbx.pause() is False  # already paused: 409 -> False

    resumed = Sandbox.connect(sbx.sandbox_id)
    assert resumed.sandbox_id == sbx.sandbox_id
    # the same process, continuing from where it was, with its open file and socket
    assert any(p.pid == pid for p in resumed.commands.list())
    after = counter(resumed)
    assert after >= before
    wait_until(lambda: counter(resumed) > after, 30, f"the resumed process to count on past {after}")
    assert ask_socket(resumed).startswith("count=")
    lines = resumed.files.read("/tmp/log.txt").split()
    assert lines == [str(i) for i in range(1, len(lines) + 1)]  # one unbroken sequence: no restart
    assert resumed.files.read("/home/user/notes.txt") == "written before the pause"
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.RUNNING


def test_pause_of_a_sandbox_using_most_of_its_memory(new_sandbox) -> None:
    """The checkpoint image is as large as the memory in use; written where it is charged to the sandbox's own
    memory limit (tmpfs), it OOM-killed a sandbox holding 300 of its 512 MB in the middle of its pause."""
    sbx = new_sandbox(timeout=300)
    sbx.commands.run("python3 -c \"import hashlib,os,time; b=os.urandom(300<<20); "
                     "open('/tmp/sum','w').write(hashlib.sha256(b).hexdigest()); time.sleep(3600)\" "
                     ">/dev/null 2>&1 &")
    # the file exists from its open() on; its digest is there once the write is done
    digest = wait_until(lambda: sbx.files.exists("/tmp/sum") and len(sbx.files.read("/tmp/sum")) == 64 and
                        sbx.files.read("/tmp/sum"), 120, "the sandbox to hold 300 MiB of fresh memory")
    assert sbx.pause() is True
    resumed = Sandbox.connect(sbx.sandbox_id)
    assert resumed.files.read("/tmp/sum") == digest
    assert "os.urandom(300<<20)" in resumed.commands.run("ps -eo args").stdout  # the process lives on


def test_a_refused_connection_attempt_leaves_the_sandbox_pausable(new_sandbox) -> None:
    """A connection a sandbox may not make (here: a closed port of its own gateway, the host end of its link; no
    packet leaves the host) is refused at once, not left half-open: gVisor cannot checkpoint a TCP endpoint in the
    middle of a handshake, so a dropped attempt would fail every pause for the two minutes it is retried."""
    sbx = new_sandbox(timeout=120)
    gateway = sbx.commands.run("ip route | awk '/^default/ {print $3}'").stdout.strip()
    assert gateway.startswith("10.88."), gateway
    attempt = sbx.commands.run(f"timeout 20 bash -c 'exec 3<>/dev/tcp/{gateway}/9'; echo $?", timeout=60)
    assert attempt.stdout.strip() == "1", attempt  # refused (1), not still trying when `timeout` ended it (124)
    sbx.commands.run(f"bash -c 'exec 3<>/dev/tcp/{gateway}/9' 2>/dev/null; echo done > /tmp/attempted",
                     background=True)
    wait_until(lambda: sbx.files.exists("/tmp/attempted"), 20, "the background connection attempt to end")
    sbx.pause()
    resumed = Sandbox.connect(sbx.sandbox_id)
    assert resumed.files.read("/tmp/attempted") == "done\n"


def test_connect_to_running_after_resume_is_200_path(new_sandbox) -> None:
    sbx = new_sandbox()
    sbx.pause()
    Sandbox.connect(sbx.sandbox_id)
    again = Sandbox.connect(sbx.sandbox_id)  # running now: a plain connect
    assert again.commands.run("echo ok").stdout == "ok\n"


def test_auto_pause_on_timeout(e2b_env) -> None:
    try:
        sbx = Sandbox.create(timeout=2, lifecycle={"on_timeout": "pause"})
    except TypeError:
        pytest.skip("this SDK version has no lifecycle= argument")
    try:
        sbx.files.write("/home/user/kept.txt", "kept")
        # its 2 s timeout elapses while we watch for the outcome
        wait_until(lambda: Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED, 60,
                   "the sandbox to be paused at its timeout", every=0.5)
        resumed = Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert resumed.files.read("/home/user/kept.txt") == "kept"
    finally:
        Sandbox.kill(sbx.sandbox_id)


def test_fork_into_five_diverging_copies_with_lineage(new_sandbox, server) -> None:
    sbx = new_sandbox(timeout=300)
    start_stateful(sbx)
    sbx.commands.run("python3 -c \"import random; random.seed(7)\" && echo base > /home/user/branch.txt")
    forks = sbx.fork(count=5, timeout=120)
    try:
        assert len(forks) == 5
        assert all(isinstance(f, Sandbox) for f in forks), forks
        ids = {f.sandbox_id for f in forks}
        assert len(ids) == 5 and sbx.sandbox_id not in ids
        tokens = {f._envd_access_token for f in forks} | {sbx._envd_access_token}
        assert len(tokens) == 6  # each fork has its own access token
        addresses = {f.commands.run("ip -4 -o addr show eth0").stdout.split()[3] for f in forks}
        assert len(addresses) == 5
        for i, f in enumerate(forks):
            assert f.files.read("/home/user/branch.txt") == "base\n"
            assert f.files.read("/home/user/notes.txt") == "written before the pause"
            f.files.write("/home/user/branch.txt", f"fork {i}\n")
            assert counter(f) > 0 and ask_socket(f).startswith("count=")
        for i, f in enumerate(forks):
            assert f.files.read("/home/user/branch.txt") == f"fork {i}\n"
            # a process can tell it was forked, and into which sandbox
            identity = json.loads(f.files.read("/run/keepstate/identity.json"))
            assert identity["sandboxId"] == f.sandbox_id and identity["fork"]["parent"] == sbx.sandbox_id
        assert sbx.files.read("/home/user/branch.txt") == "base\n"  # the original is untouched

        tree = api(server, f"/sandboxes/{sbx.sandbox_id}/lineage")
        text = json.dumps(tree)
        for f in forks:
            assert f.sandbox_id in text
        child_history = api(server, f"/sandboxes/{forks[0].sandbox_id}/events?verify=true")
        assert child_history["events"][0]["kind"] == "session.fork"
        assert child_history["events"][0]["data"]["parent_session"] == sbx.sandbox_id
        assert child_history["verified"]["ok"] is True
    finally:
        for f in forks:
            if isinstance(f, Sandbox):
                f.kill()


def test_snapshot_is_a_template(new_sandbox) -> None:
    sbx = new_sandbox()
    sbx.files.write("/home/user/snap.txt", "in the snapshot")
    snap = sbx.create_snapshot()
    try:
        assert snap.snapshot_id
        listed = [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()]
        assert snap.snapshot_id in listed
        child = Sandbox.create(template=snap.snapshot_id, timeout=120)
        try:
            assert child.sandbox_id != sbx.sandbox_id
            assert child.files.read("/home/user/snap.txt") == "in the snapshot"
        finally:
            child.kill()
        assert sbx.files.read("/home/user/snap.txt") == "in the snapshot"  # still running after the snapshot
    finally:
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert Sandbox.delete_snapshot(snap.snapshot_id) is False


def test_history_records_the_session(new_sandbox, server) -> None:
    sbx = new_sandbox()
    sbx.commands.run("echo recorded > /tmp/x")
    sbx.files.write("/home/user/h.txt", "h")
    sbx.pause()
    Sandbox.connect(sbx.sandbox_id)
    expected = {"process.start", "process.exit", "file.write", "checkpoint", "sandbox.pause", "sandbox.resume"}
    kinds: list[str] = []

    def complete() -> dict | None:  # the agent's journal reaches the history when the server pulls it
        history = api(server, f"/sandboxes/{sbx.sandbox_id}/events?verify=true")
        assert isinstance(history, dict)
        kinds[:] = [e["kind"] for e in history["events"]]
        return history if expected <= set(kinds) else None

    history = wait_until(complete, 15, lambda: f"the history to hold every one of {sorted(expected)}: {kinds}",
                         every=0.5)
    assert kinds[0] == "sandbox.create"
    assert history["verified"]["ok"] is True
    # paused moments ago on this server: its frozen standby was thawed, not restored from the store
    assert [e["data"]["from"] for e in history["events"] if e["kind"] == "sandbox.resume"] == ["standby"]
    events = history["events"]
    for prev, ev in zip(events, events[1:], strict=False):
        assert ev["prev"] == prev["hash"] and ev["seq"] == prev["seq"] + 1
