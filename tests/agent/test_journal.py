"""The journal: pure ring-buffer logic, and `GET /journal` recording what the SDK did."""

from __future__ import annotations

import pytest

from tests.agent.harness import REMOTE, wire_of


def test_journal_sequence_capacity_and_pages() -> None:
    journal_mod = pytest.importorskip("keepstate.agent.journal")
    clock = iter(range(100, 200))
    journal = journal_mod.Journal(capacity=3, clock=lambda: float(next(clock)))
    assert journal.page(0) == {"events": [], "next": 0, "oldest": 1, "last": 0}
    for i in range(5):
        assert journal.append("file.remove", {"path": f"/p{i}"}) == i + 1
    page = journal.page(0)
    assert [e["seq"] for e in page["events"]] == [3, 4, 5]  # 1 and 2 fell out of the buffer
    assert (page["next"], page["oldest"], page["last"]) == (5, 3, 5)
    assert page["events"][0] == {"seq": 3, "ts": 102.0, "kind": "file.remove", "data": {"path": "/p2"}}
    assert [e["seq"] for e in journal.page(3, limit=1)["events"]] == [4]
    assert journal.page(5) == {"events": [], "next": 5, "oldest": 3, "last": 5}
    assert journal.page(99)["next"] == 5  # a cursor from another journal is pulled back
    assert journal_mod.parse_query({}) == (0, 1000)
    assert journal_mod.parse_query({"after": "7", "limit": "999999"}) == (7, journal_mod.CAPACITY)
    for bad in ({"after": "x"}, {"limit": "-1"}):
        with pytest.raises(journal_mod.JournalQueryError):
            journal_mod.parse_query(bad)


def _events_after(http, after: int) -> list[dict]:  # type: ignore[no-untyped-def]
    events: list[dict] = []
    while True:
        page = http.get("/journal", params={"after": after, "limit": 50}).json()
        events += page["events"]
        if not page["events"]:
            return events
        after = page["next"]


def test_journal_records_sdk_actions(sandbox, home_dir) -> None:
    wire = wire_of(sandbox)
    http = wire.client(authed=True)
    assert wire.client().get("/journal").status_code == 401  # needs the access token
    assert http.get("/journal", params={"after": "soon"}).status_code == 400
    start = http.get("/journal", params={"limit": 0}).json()["last"]

    sandbox.files.write_files([{"path": f"{home_dir}/a.txt", "data": "hello"},
                               {"path": f"{home_dir}/b.txt", "data": "xy"}])
    sandbox.files.make_dir(f"{home_dir}/d")
    sandbox.files.rename(f"{home_dir}/a.txt", f"{home_dir}/d/a.txt")
    sandbox.files.remove(f"{home_dir}/b.txt")
    handle = sandbox.commands.run("exit 3", background=True, cwd=home_dir)
    pid = handle.pid
    try:
        handle.wait()
    except Exception:  # noqa: BLE001 - the exit status is what we check, in the journal
        pass

    events = _events_after(http, start)
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(start + 1, start + 1 + len(seqs)))
    mine = [(e["kind"], e["data"]) for e in events
            if home_dir in str(e["data"]) or e["data"].get("pid") == pid]
    assert mine == [
        ("file.write", {"path": f"{home_dir}/a.txt", "size": 5, "user": "user"}),
        ("file.write", {"path": f"{home_dir}/b.txt", "size": 2, "user": "user"}),
        ("dir.make", {"path": f"{home_dir}/d"}),
        ("file.move", {"source": f"{home_dir}/a.txt", "destination": f"{home_dir}/d/a.txt"}),
        ("file.remove", {"path": f"{home_dir}/b.txt"}),
        ("process.start", {"pid": pid, "cmd": "/bin/bash", "args": ["-l", "-c", "exit 3"], "cwd": home_dir,
                           "user": "user", "tag": None, "pty": False}),
        ("process.exit", {"pid": pid, "exitCode": 3, "status": "exit status 3"}),
    ]
    assert all(isinstance(e["ts"], float) for e in events)


def test_journal_keeps_the_first_lines_a_process_prints(sandbox) -> None:
    http = wire_of(sandbox).client(authed=True)
    start = http.get("/journal", params={"limit": 0}).json()["last"]
    quiet = sandbox.commands.run("echo one; echo two >&2; printf '\\n\\nthree\\n'")
    chatty = sandbox.commands.run("for i in $(seq 1 500); do echo line $i; done")
    assert quiet.exit_code == 0 and chatty.stdout.count("\n") == 500

    events = _events_after(http, start)
    pids = [e["data"]["pid"] for e in events if e["kind"] == "process.start"]
    assert len(pids) == 2

    def output(pid: int) -> list[dict]:  # type: ignore[type-arg]
        return [e["data"] for e in events if e["kind"] == "process.output" and e["data"]["pid"] == pid]

    quiet_out = output(pids[0])
    assert sorted((d["stream"], d["text"]) for d in quiet_out) == [("stderr", "two"), ("stdout", "one"),
                                                                     ("stdout", "three")]
    chatty_out = output(pids[1])
    assert len(chatty_out) == 21 and chatty_out[-1] == {"pid": pids[1], "truncated": True}
    assert [d["text"] for d in chatty_out[:20]] == [f"line {i}" for i in range(1, 21)]  # in order, whole lines
    exits = [i for i, e in enumerate(events) if e["kind"] == "process.exit" and e["data"]["pid"] == pids[1]]
    outs = [i for i, e in enumerate(events) if e["kind"] == "process.output" and e["data"]["pid"] == pids[1]]
    assert exits and max(outs) < exits[0]  # the output comes before the exit


@pytest.mark.skipif(not REMOTE, reason="needs real sandboxes: checkpoints are the server's")
def test_journal_continues_across_pause_and_fork(control_plane) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=120)
    made = [sbx]
    try:
        sbx.files.write("/tmp/before.txt", "b")
        before = wire_of(sbx).client(authed=True).get("/journal", params={"limit": 0}).json()["last"]
        assert before >= 1
        sbx.pause()
        resumed = Sandbox.connect(sbx.sandbox_id)
        resumed.files.write("/tmp/after.txt", "a")
        events = wire_of(resumed).client(authed=True).get("/journal", params={"after": before}).json()["events"]
        assert [(e["seq"], e["kind"], e["data"]["path"]) for e in events] == [
            (before + 1, "file.write", "/tmp/after.txt")]
        forks = resumed.fork(count=1) if hasattr(resumed, "fork") else []
        for fork in forks:
            assert not isinstance(fork, Exception), fork
            made.append(fork)
            fork.files.write("/tmp/in-fork.txt", "f")
            page = wire_of(fork).client(authed=True).get("/journal", params={"after": before + 1}).json()
            assert [(e["seq"], e["data"]["path"]) for e in page["events"]] == [(before + 2, "/tmp/in-fork.txt")]
    finally:
        for s in made:
            try:
                s.kill()
            except Exception:  # noqa: BLE001 - best effort clean-up
                pass
