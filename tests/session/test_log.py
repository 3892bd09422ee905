"""EventLog on SQLite and PostgreSQL: appends, tamper detection per stored field, concurrency, forks,
export/import."""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path

import pytest
import sqlalchemy as sa

from keepstate.db import migrate
from keepstate.db.engine import Database
from keepstate.db.url import default_url
from keepstate.errors import BadRequest, Conflict, NotFound
from keepstate.session import GENESIS, EventLog, EventRef


async def test_append_read_head(log: EventLog) -> None:
    a = await log.append("s1", "sandbox.create", {"template_id": "base"})
    b = await log.append("s1", "sandbox.connect")
    await log.append("other", "sandbox.create", {})
    assert (a.seq, a.prev, b.seq, b.prev) == (1, GENESIS, 2, a.hash)
    assert [e.seq for e in await log.read("s1")] == [1, 2]
    assert [e.seq for e in await log.read("s1", after=1)] == [2]
    assert [e.seq for e in await log.read("s1", limit=1)] == [1]
    assert await log.head("s1") == b and await log.head("nobody") is None
    assert (await log.read("s1"))[0].data == {"template_id": "base"}
    with pytest.raises(BadRequest):
        await log.append("s1", "", {})
    with pytest.raises(BadRequest, match="JSON"):
        await log.append("s1", "x", {"v": object()})


async def _tamper(log: EventLog, sql: str, **args: object) -> None:
    """Edit the stored rows behind the log's back, as an attacker with the database would."""
    async with log.history.db.transaction() as conn:
        await conn.execute(sa.text(sql), args)


@pytest.mark.parametrize(("field", "value", "bad_seq"), [
    ("ts", 12345.0, 3), ("kind", "sandbox.kill", 3), ("data", '{"i":99}', 3), ("data", '{ "i":2}', 3),
    ("prev", "1" * 64, 3), ("hash", "2" * 64, 3), ("seq", 9, 3), ("session_id", "elsewhere", 3),
])
async def test_editing_any_stored_field_fails_verify_naming_the_seq(log: EventLog, field: str, value: object,
                                                                    bad_seq: int) -> None:
    for i in range(5):
        await log.append("s1", "step", {"i": i})
    assert (await log.verify("s1")).ok
    await _tamper(log, f"UPDATE events SET {field}=:v WHERE session_id='s1' AND seq=3", v=value)
    result = await log.verify("s1")
    assert not result.ok and result.first_bad_seq == bad_seq, result
    assert result.checked == 2


async def test_editing_the_last_event_or_truncating_fails(log: EventLog) -> None:
    for i in range(3):
        await log.append("s1", "step", {"i": i})
    await _tamper(log, "DELETE FROM events WHERE session_id='s1' AND seq=3")
    result = await log.verify("s1")
    assert not result.ok and result.first_bad_seq == 3 and "truncated" in (result.reason or "")


async def _append_many_async(url: str, session_id: str, n: int, writer: str) -> None:
    db = await Database.open(url)
    try:
        log = EventLog(db)
        for i in range(n):
            await log.append(session_id, "step", {"writer": writer, "i": i})
    finally:
        await db.close()


def _append_many(url: str, session_id: str, n: int) -> None:
    asyncio.run(_append_many_async(url, session_id, n, multiprocessing.current_process().name))


async def test_concurrent_tasks_and_processes_never_fork_the_chain(db_url: str, database: Database) -> None:
    url = db_url
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(url, "shared", 15), name=f"p{i}") for i in range(2)]
    for p in procs:
        p.start()
    shared = EventLog(database)

    async def on_shared() -> None:
        for _ in range(15):
            await shared.append("shared", "step", {"t": 1})

    # two tasks on this process's Database, two more each on a Database of its own (as two servers), two processes
    await asyncio.gather(on_shared(), on_shared(),
                         *(_append_many_async(url, "shared", 15, f"db{i}") for i in range(2)))
    for p in procs:
        await asyncio.to_thread(p.join, 120)
        assert p.exitcode == 0
    events = await shared.read("shared")
    assert [e.seq for e in events] == list(range(1, 91))
    assert (await shared.verify("shared")).ok


async def test_fork_links_child_to_parent_checkpoint_event(log: EventLog) -> None:
    await log.append("parent", "sandbox.create", {"template_id": "base"})
    await log.append("parent", "process.start", {"pid": 1})
    cp = await log.append("parent", "checkpoint", {"checkpoint_id": "cp1", "parent_id": None, "kind": "fork",
                                                    "journal_cursor": 7})
    first = await log.start_fork("child", "parent", "cp1", EventRef(cp.seq, cp.hash))
    assert first.seq == 1 and first.kind == "session.fork"
    assert first.data["parent_event"] == {"seq": cp.seq, "hash": cp.hash}
    assert (await log.head("parent")).kind == "fork.child"  # type: ignore[union-attr]
    assert await log.journal_cursor("child") == 7
    assert (await log.verify("child")).ok and (await log.verify("parent")).ok
    history = await log.causal_history("child")
    assert [(e.session_id, e.seq) for e in history] == [("parent", 1), ("parent", 2), ("parent", 3), ("child", 1)]
    with pytest.raises(Conflict):
        await log.start_fork("child", "parent", "cp1", EventRef(cp.seq, cp.hash))
    with pytest.raises(Conflict):
        await log.start_fork("child2", "parent", "cp1", EventRef(cp.seq, "f" * 64))
    with pytest.raises(NotFound):
        await log.start_fork("child3", "parent", "cp1", EventRef(99, cp.hash))


async def test_fork_link_tamper_in_parent_breaks_child_verify(log: EventLog) -> None:
    await log.append("p", "sandbox.create", {})
    cp = await log.append("p", "checkpoint", {"checkpoint_id": "c"})
    await log.start_fork("c1", "p", "c", EventRef(cp.seq, cp.hash))
    # rewrite the parent's history consistently (every hash recomputed): only the fork link can tell
    await _tamper(log, "DELETE FROM events WHERE session_id='p'")
    await _tamper(log, "DELETE FROM heads WHERE session_id='p'")
    await log.append("p", "sandbox.create", {"forged": True})
    await log.append("p", "checkpoint", {"checkpoint_id": "c"})
    result = await log.verify("c1")
    assert not result.ok and result.first_bad_seq == 1 and "fork link" in (result.reason or "")


async def test_export_import_to_another_server(tmp_path: Path, log: EventLog) -> None:
    """The other servers' databases are SQLite files: the history travels between engines too."""
    await log.append("p", "sandbox.create", {"template_id": "base"})
    cp = await log.append("p", "checkpoint", {"checkpoint_id": "c"})
    await log.start_fork("k", "p", "c", EventRef(cp.seq, cp.hash))
    await log.append("k", "process.start", {"pid": 3})
    exported = await log.export("k")
    assert [e["session_id"] for e in exported] == ["p", "p", "k", "k"]

    other_db = await Database.open(default_url(tmp_path / "other"))
    third_db = await Database.open(default_url(tmp_path / "third"))
    for d in (other_db, third_db):
        await migrate.upgrade(d)
    other, third = EventLog(other_db), EventLog(third_db)
    assert await other.import_(exported) == {"p": 2, "k": 2}
    assert (await other.verify("k")).ok and (await other.verify("p")).ok
    assert await other.import_(exported) == {"p": 0, "k": 0}  # idempotent
    await log.append("k", "process.exit", {"pid": 3, "exitCode": 0})
    assert await other.import_(await log.export("k")) == {"p": 0, "k": 1}  # a prefix is extended

    await other.append("k", "sandbox.kill", {"reason": "diverged here"})
    await log.append("k", "sandbox.pause", {})
    with pytest.raises(Conflict):
        await other.import_(await log.export("k"))
    forged = await log.export("k")
    forged[1]["data"] = {"checkpoint_id": "evil"}
    with pytest.raises(BadRequest, match="does not verify"):
        await third.import_(forged)
    assert await third.read("p") == []
    await other_db.close()
    await third_db.close()


async def test_unknown_session_is_not_found(log: EventLog) -> None:
    with pytest.raises(NotFound):
        await log.verify("ghost")
    with pytest.raises(NotFound):
        await log.export("ghost")
