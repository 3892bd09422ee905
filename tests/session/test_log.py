"""EventLog on a real SQLite file: appends, tamper detection per stored field, concurrency, forks, export/import."""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
from pathlib import Path

import pytest

from keepstate.errors import BadRequest, Conflict, NotFound
from keepstate.session import GENESIS, EventLog, EventRef


def test_append_read_head(log: EventLog) -> None:
    a = log.append("s1", "sandbox.create", {"template_id": "base"})
    b = log.append("s1", "sandbox.connect")
    log.append("other", "sandbox.create", {})
    assert (a.seq, a.prev, b.seq, b.prev) == (1, GENESIS, 2, a.hash)
    assert [e.seq for e in log.read("s1")] == [1, 2]
    assert [e.seq for e in log.read("s1", after=1)] == [2]
    assert [e.seq for e in log.read("s1", limit=1)] == [1]
    assert log.head("s1") == b and log.head("nobody") is None
    assert log.read("s1")[0].data == {"template_id": "base"}
    with pytest.raises(BadRequest):
        log.append("s1", "", {})
    with pytest.raises(BadRequest, match="JSON"):
        log.append("s1", "x", {"v": object()})


def _tamper(path: Path, sql: str, *args: object) -> None:
    con = sqlite3.connect(path)
    con.execute(sql, args)
    con.commit()
    con.close()


@pytest.mark.parametrize(("field", "value", "bad_seq"), [
    ("ts", 12345.0, 3), ("kind", "sandbox.kill", 3), ("data", '{"i":99}', 3), ("data", '{ "i":2}', 3),
    ("prev", "1" * 64, 3), ("hash", "2" * 64, 3), ("seq", 9, 3), ("session_id", "elsewhere", 3),
])
def test_editing_any_stored_field_fails_verify_naming_the_seq(db_path: Path, field: str, value: object,
                                                              bad_seq: int) -> None:
    log = EventLog(db_path)
    for i in range(5):
        log.append("s1", "step", {"i": i})
    assert log.verify("s1").ok
    _tamper(db_path, f"UPDATE events SET {field}=? WHERE session_id='s1' AND seq=3", value)
    result = log.verify("s1")
    assert not result.ok and result.first_bad_seq == bad_seq, result
    assert result.checked == 2
    log.close()


def test_editing_the_last_event_or_truncating_fails(db_path: Path) -> None:
    log = EventLog(db_path)
    for i in range(3):
        log.append("s1", "step", {"i": i})
    _tamper(db_path, "DELETE FROM events WHERE session_id='s1' AND seq=3")
    result = log.verify("s1")
    assert not result.ok and result.first_bad_seq == 3 and "truncated" in (result.reason or "")
    log.close()


def _append_many(path: str, session_id: str, n: int) -> None:
    log = EventLog(Path(path))
    for i in range(n):
        log.append(session_id, "step", {"writer": multiprocessing.current_process().name, "i": i})
    log.close()


def test_concurrent_threads_and_processes_never_fork_the_chain(db_path: Path) -> None:
    EventLog(db_path).close()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(str(db_path), "shared", 15), name=f"p{i}") for i in range(2)]
    for p in procs:
        p.start()
    shared = EventLog(db_path)
    threads = [threading.Thread(target=lambda: [shared.append("shared", "step", {"t": 1}) for _ in range(15)])
               for _ in range(2)]
    separate = [threading.Thread(target=_append_many, args=(str(db_path), "shared", 15)) for _ in range(2)]
    for t in [*threads, *separate]:
        t.start()
    for t in [*threads, *separate]:
        t.join(timeout=60)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    events = shared.read("shared")
    assert [e.seq for e in events] == list(range(1, 91))
    assert shared.verify("shared").ok
    shared.close()


def test_fork_links_child_to_parent_checkpoint_event(log: EventLog) -> None:
    log.append("parent", "sandbox.create", {"template_id": "base"})
    log.append("parent", "process.start", {"pid": 1})
    cp = log.append("parent", "checkpoint", {"checkpoint_id": "cp1", "parent_id": None, "kind": "fork",
                                              "journal_cursor": 7})
    first = log.start_fork("child", "parent", "cp1", EventRef(cp.seq, cp.hash))
    assert first.seq == 1 and first.kind == "session.fork"
    assert first.data["parent_event"] == {"seq": cp.seq, "hash": cp.hash}
    assert log.head("parent").kind == "fork.child"  # type: ignore[union-attr]
    assert log.journal_cursor("child") == 7
    assert log.verify("child").ok and log.verify("parent").ok
    history = log.causal_history("child")
    assert [(e.session_id, e.seq) for e in history] == [("parent", 1), ("parent", 2), ("parent", 3), ("child", 1)]
    with pytest.raises(Conflict):
        log.start_fork("child", "parent", "cp1", EventRef(cp.seq, cp.hash))
    with pytest.raises(Conflict):
        log.start_fork("child2", "parent", "cp1", EventRef(cp.seq, "f" * 64))
    with pytest.raises(NotFound):
        log.start_fork("child3", "parent", "cp1", EventRef(99, cp.hash))


def test_fork_link_tamper_in_parent_breaks_child_verify(db_path: Path) -> None:
    log = EventLog(db_path)
    log.append("p", "sandbox.create", {})
    cp = log.append("p", "checkpoint", {"checkpoint_id": "c"})
    log.start_fork("c1", "p", "c", EventRef(cp.seq, cp.hash))
    # rewrite the parent's history consistently (every hash recomputed): only the fork link can tell
    _tamper(db_path, "DELETE FROM events WHERE session_id='p'")
    _tamper(db_path, "DELETE FROM heads WHERE session_id='p'")
    log.append("p", "sandbox.create", {"forged": True})
    log.append("p", "checkpoint", {"checkpoint_id": "c"})
    result = log.verify("c1")
    assert not result.ok and result.first_bad_seq == 1 and "fork link" in (result.reason or "")
    log.close()


def test_export_import_to_another_server(tmp_path: Path, log: EventLog) -> None:
    log.append("p", "sandbox.create", {"template_id": "base"})
    cp = log.append("p", "checkpoint", {"checkpoint_id": "c"})
    log.start_fork("k", "p", "c", EventRef(cp.seq, cp.hash))
    log.append("k", "process.start", {"pid": 3})
    exported = log.export("k")
    assert [e["session_id"] for e in exported] == ["p", "p", "k", "k"]

    other = EventLog(tmp_path / "other.sqlite")
    assert other.import_(exported) == {"p": 2, "k": 2}
    assert other.verify("k").ok and other.verify("p").ok
    assert other.import_(exported) == {"p": 0, "k": 0}  # idempotent
    log.append("k", "process.exit", {"pid": 3, "exitCode": 0})
    assert other.import_(log.export("k")) == {"p": 0, "k": 1}  # a prefix is extended

    other.append("k", "sandbox.kill", {"reason": "diverged here"})
    log.append("k", "sandbox.pause", {})
    with pytest.raises(Conflict):
        other.import_(log.export("k"))
    forged = log.export("k")
    forged[1]["data"] = {"checkpoint_id": "evil"}
    with pytest.raises(BadRequest, match="does not verify"):
        EventLog(tmp_path / "third.sqlite").import_(forged)
    other.close()


def test_unknown_session_is_not_found(log: EventLog) -> None:
    with pytest.raises(NotFound):
        log.verify("ghost")
    with pytest.raises(NotFound):
        log.export("ghost")
