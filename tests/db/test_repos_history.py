"""History on SQLite and PostgreSQL: appends that never fork a chain (two writers, two Databases), the conditional
append, the journal cursor's compare-and-set, forks, and the sessions and checkpoints of the lineage."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from keepstate.db.engine import Database
from keepstate.db.errors import Stale
from keepstate.db.records import CheckpointRecord, EventRecord, HeadRecord, SessionRecord
from keepstate.db.repos import History
from keepstate.db.repos.history import Link
from keepstate.errors import Conflict

from .race import HeldCommit, race

GENESIS = "0" * 64


def event(session_id: str, seq: int, prev: str, kind: str = "step", data: str = "{}", ts: float = 1.0) -> EventRecord:
    digest = hashlib.sha256(f"{session_id}|{seq}|{ts}|{kind}|{data}|{prev}".encode()).hexdigest()
    return EventRecord(session_id=session_id, seq=seq, ts=ts, kind=kind, data=data, prev=prev, hash=digest)


def link(session_id: str, kind: str = "step", data: str = "{}") -> Link:
    """What keepstate.session passes: the next event from the head, a pure function."""
    def make(head: HeadRecord | None) -> EventRecord:
        return event(session_id, (head.seq if head else 0) + 1, head.hash if head else GENESIS, kind, data)
    return make


def assert_linked(evs: list[EventRecord], n: int) -> None:
    assert [e.seq for e in evs] == list(range(1, n + 1))
    prev = GENESIS
    for e in evs:
        assert e.prev == prev, e
        prev = e.hash


async def test_extend_reads_head_last_event_and_chain(database: Database) -> None:
    history = History(database)
    a, b = await history.extend("s1", [link("s1", data='{"i":1}'), link("s1", data='{"i":2}')])
    (c,) = await history.extend("s1", [link("s1", "other")])
    await history.extend("s2", [link("s2")])
    assert (a.seq, a.prev, b.seq, b.prev, c.seq, c.prev) == (1, GENESIS, 2, a.hash, 3, b.hash)
    assert await history.events("s1") == [a, b, c]
    assert await history.events("s1", after=1, limit=1) == [b]
    assert await history.event("s1", 2) == b and await history.event("s1", 9) is None
    assert await history.last_event("s1") == c and await history.last_event("nobody") is None
    assert await history.head("s1") == HeadRecord(session_id="s1", seq=3, hash=c.hash)
    assert await history.has_events("s1") and not await history.has_events("nobody")
    assert await history.extend("s1", []) == []
    rows, head = await history.chain("s1")
    assert rows == [a, b, c] and head == HeadRecord(session_id="s1", seq=3, hash=c.hash)
    assert await history.chain("nobody") == ([], None)


async def test_a_link_that_does_not_continue_the_head_writes_nothing(database: Database) -> None:
    history = History(database)
    await history.extend("s1", [link("s1")])
    with pytest.raises(ValueError, match="does not continue"):
        await history.extend("s1", [link("s1"), lambda head: event("s1", 5, "x" * 64)])
    with pytest.raises(ValueError, match="names session"):
        await history.extend("s1", [link("s2")])
    assert len(await history.events("s1")) == 1


async def test_two_appenders_on_two_databases_never_fork_the_chain(database: Database,
                                                                   other_database: Database) -> None:
    one, two = History(database), History(other_database)

    async def writer(history: History, n: int) -> None:
        for _ in range(n):
            await history.extend("shared", [link("shared")])

    await asyncio.gather(writer(one, 15), writer(two, 15), writer(one, 5), writer(two, 5))
    evs = await one.events("shared")
    assert_linked(evs, 40)
    assert (await two.head("shared")).seq == 40  # type: ignore[union-attr]


async def test_a_second_appender_waits_then_links_to_the_first(database: Database,
                                                               held_database: HeldCommit) -> None:
    held = held_database
    first, second = await race(held, lambda: History(held).extend("s", [link("s", data='{"w":1}')]),
                               lambda: History(database).extend("s", [link("s", data='{"w":2}')]))
    assert first[0].seq == 1 and second[0].seq == 2 and second[0].prev == first[0].hash
    assert_linked(await History(database).events("s"), 2)


async def test_conditional_append_after_the_head_it_was_given(database: Database) -> None:
    history = History(database)
    e1 = event("s", 1, GENESIS)
    await history.append("s", [e1], expect_head=None)
    e2 = event("s", 2, e1.hash)
    e3 = event("s", 3, e2.hash)
    await history.append("s", [e2, e3], expect_head=(1, e1.hash))
    with pytest.raises(Stale):  # a writer that read the head before e2 and e3: nothing is written
        await history.append("s", [event("s", 2, e1.hash, "late")], expect_head=(1, e1.hash))
    with pytest.raises(Stale):
        await history.append("s", [event("s", 1, GENESIS, "late")], expect_head=None)
    with pytest.raises(ValueError, match="does not continue"):
        await history.append("s", [event("s", 5, e3.hash)], expect_head=(3, e3.hash))
    assert await history.events("s") == [e1, e2, e3]
    # several sessions in one transaction: all or none
    f1 = event("f", 1, GENESIS)
    with pytest.raises(Stale):
        await history.append_chains([("f", None, [f1]), ("s", (2, e2.hash), [event("s", 3, e2.hash)])])
    assert await history.events("f") == []
    await history.append_chains([("f", None, [f1]), ("s", (3, e3.hash), [])])
    assert await history.events("f") == [f1]


async def test_two_conditional_appends_at_one_head_one_is_stale(database: Database,
                                                                held_database: HeldCommit) -> None:
    e1 = event("s", 1, GENESIS)
    await History(database).append("s", [e1], expect_head=None)
    outcomes = await race(held_database,
                          lambda: History(held_database).append("s", [event("s", 2, e1.hash, "a")], (1, e1.hash)),
                          lambda: History(database).append("s", [event("s", 2, e1.hash, "b")], (1, e1.hash)))
    assert outcomes[0] is None and isinstance(outcomes[1], Stale)
    assert [e.kind for e in await History(database).events("s")] == ["step", "a"]


async def test_journal_cursor_compare_and_set(database: Database) -> None:
    history = History(database)
    assert await history.journal_cursor("s") is None
    written = await history.append_journal("s", 0, [link("s", "j1"), link("s", "j2")], 2)
    assert [e.kind for e in written or []] == ["j1", "j2"] and await history.journal_cursor("s") == 2
    # a puller that still believes the cursor is 0: nothing appended, cursor unchanged
    assert await history.append_journal("s", 0, [link("s", "again")], 1) is None
    assert len(await history.events("s")) == 2 and await history.journal_cursor("s") == 2
    assert await history.append_journal("s", 2, [link("s", "j3")], 3) is not None
    assert_linked(await history.events("s"), 3)
    # set: whatever it was; a session with no event gets a head at seq 0, which is no head for the chain
    await history.set_journal_cursor("s", 1)
    await history.set_journal_cursor("fresh", 7)
    assert await history.journal_cursor("s") == 1 and await history.journal_cursor("fresh") == 7
    assert (await history.head("s")).seq == 3  # type: ignore[union-attr]
    assert not await history.has_events("fresh") and await history.last_event("fresh") is None
    (first,) = await history.extend("fresh", [link("fresh")])
    assert first.seq == 1 and await history.journal_cursor("fresh") == 7
    assert await history.append_journal("nobody", 5, [link("nobody")], 6) is None
    assert await history.head("nobody") is None  # a refused compare-and-set leaves no row behind


async def test_two_pullers_racing_one_cursor_one_appends(database: Database, held_database: HeldCommit) -> None:
    outcomes = await race(held_database,
                          lambda: History(held_database).append_journal("s", 0, [link("s", "a")], 1),
                          lambda: History(database).append_journal("s", 0, [link("s", "b")], 1))
    assert outcomes[0] is not None and outcomes[1] is None
    assert [e.kind for e in await History(database).events("s")] == ["a"]


async def test_start_fork(database: Database) -> None:
    history = History(database)
    await history.extend("p", [link("p"), link("p", "checkpoint")])
    parent_ev, child_ev = await history.start_fork("p", link("p", "fork.child"), "c", link("c", "session.fork"),
                                                   child_cursor=7)
    assert (parent_ev.seq, parent_ev.kind, child_ev.seq, child_ev.prev) == (3, "fork.child", 1, GENESIS)
    assert await history.journal_cursor("c") == 7 and await history.last_event("c") == child_ev
    with pytest.raises(Conflict, match="already has a history"):
        await history.start_fork("p", link("p", "fork.child"), "c", link("c", "session.fork"))
    assert len(await history.events("p")) == 3  # nothing written by the refused fork
    await history.set_journal_cursor("c2", 4)  # a head at seq 0 is no history: the fork may start
    await history.start_fork("p", link("p", "fork.child"), "c2", link("c2", "session.fork"))
    assert await history.journal_cursor("c2") == 4
    with pytest.raises(Conflict):
        await history.start_fork("p", link("p"), "p", link("p"))


def session(session_id: str, template_id: str | None = "base", created: float = 1.0, state: str = "running",
            parent: str | None = None, checkpoint: str | None = None) -> SessionRecord:
    return SessionRecord(session_id=session_id, template_id=template_id, created=created, parent_session=parent,
                         parent_checkpoint_id=checkpoint, state=state)


async def test_sessions(database: Database) -> None:
    history = History(database)
    await history.put_session(session("root", created=1.0))
    await history.put_session(session("root", template_id=None, created=9.0, state="paused"))
    assert await history.session("root") == session("root", created=1.0, state="paused")  # None keeps, created kept
    await history.put_session(session("f2", created=5.0, parent="root", checkpoint="c1"))
    await history.put_session(session("f1", created=4.0, parent="root", checkpoint="c1"))
    await history.put_session(session("other", template_id="base", created=7.0))
    await history.put_session(session("elsewhere", template_id="slim", created=8.0))
    assert [s.session_id for s in await history.child_sessions("root")] == ["f1", "f2"]
    assert [s.session_id for s in await history.sessions_forked_from("c1")] == ["f1", "f2"]
    assert await history.sessions_forked_from("c9") == []
    assert await history.template_spawns("base") == (2, 7.0)  # forks not counted
    assert await history.template_spawns("none") == (0, None)
    assert await history.set_session_state("f1", "killed") is True
    assert await history.set_session_state("ghost", "killed") is False
    assert (await history.session("f1")).state == "killed"  # type: ignore[union-attr]
    assert await history.session("ghost") is None


async def test_checkpoints(database: Database) -> None:
    history = History(database)

    def cp(checkpoint_id: str, created: float, **kw: object) -> CheckpointRecord:
        fields: dict[str, object] = {"parent_checkpoint_id": None, "kind": "pause", "event_seq": 3,
                                     "event_hash": "a" * 64, "journal_cursor": None} | kw
        return CheckpointRecord(checkpoint_id=checkpoint_id, session_id="s", created=created,
                                **fields)  # type: ignore[arg-type]

    await history.put_checkpoint(cp("c2", 3.0))
    await history.put_checkpoint(cp("c1", 2.0, kind="snapshot", event_seq=None, event_hash=None))
    await history.put_checkpoint(cp("c2", 99.0, journal_cursor=9, parent_checkpoint_id="c1"))
    assert await history.checkpoint("c2") == cp("c2", 3.0, journal_cursor=9, parent_checkpoint_id="c1")
    assert [c.checkpoint_id for c in await history.checkpoints_of("s")] == ["c1", "c2"]
    assert await history.delete_checkpoint("c1") is True and await history.delete_checkpoint("c1") is False
    assert await history.checkpoint("c1") is None and await history.checkpoints_of("nobody") == []
