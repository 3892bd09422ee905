"""Pulling the agent's journal from a fake of its /journal endpoint, served by a real aiohttp server."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from keepstate.session import EventLog, JournalError, JournalPoller, pull_journal
from tests.session.conftest import TOKEN, FakeJournal


async def test_pull_appends_entries_in_pages_with_agent_seq(agent: tuple[FakeJournal, str], log: EventLog) -> None:
    journal, url = agent
    journal.add("process.start", pid=7, cmd="/bin/bash", args=["-c", "ls"])
    journal.add("process.exit", pid=7, exitCode=0, status="exit status 0")
    journal.add("file.write", path="/home/user/a", size=1, user="user")
    async with aiohttp.ClientSession() as http:
        cursor = await pull_journal(log, "s1", url, TOKEN, 0, http, page=2)
        assert cursor == 3
        assert [r["after"] for r in journal.requests] == ["0", "2"]
        events = await log.read("s1")
        assert [e.kind for e in events] == ["process.start", "process.exit", "file.write"]
        assert events[0].data["agent_seq"] == 1 and events[0].data["agent_ts"] == 1001.0
        assert events[0].data["pid"] == 7
        assert await pull_journal(log, "s1", url, TOKEN, cursor, http) == 3  # nothing new, nothing appended
        assert len(await log.read("s1")) == 3 and await log.journal_cursor("s1") == 3
        assert (await log.verify("s1")).ok


async def test_gap_is_recorded_when_entries_were_dropped(agent: tuple[FakeJournal, str], log: EventLog) -> None:
    journal, url = agent
    for i in range(5):
        journal.add("dir.make", path=f"/d{i}")
    journal.drop_oldest(3)
    async with aiohttp.ClientSession() as http:
        assert await pull_journal(log, "s1", url, TOKEN, 0, http) == 5
    events = await log.read("s1")
    assert events[0].kind == "journal.gap" and events[0].data == {"after": 0, "oldest": 4, "lost": 3}
    assert [e.data.get("agent_seq") for e in events[1:]] == [4, 5]


async def test_a_stale_puller_appends_nothing(agent: tuple[FakeJournal, str], log: EventLog) -> None:
    journal, url = agent
    journal.add("dir.make", path="/a")
    async with aiohttp.ClientSession() as http:
        assert await pull_journal(log, "s1", url, TOKEN, 0, http) == 1
        journal.add("dir.make", path="/b")
        # a second puller that still believes the cursor is 0 must not append /a again
        assert await pull_journal(log, "s1", url, TOKEN, 0, http) == 1
        assert [e.data["path"] for e in await log.read("s1")] == ["/a"]


async def test_errors_are_journal_errors(agent: tuple[FakeJournal, str], log: EventLog) -> None:
    journal, url = agent
    async with aiohttp.ClientSession() as http:
        with pytest.raises(JournalError, match="401"):
            await pull_journal(log, "s1", url, "wrong", 0, http)


async def test_poller_pulls_on_demand_and_in_the_background(agent: tuple[FakeJournal, str], log: EventLog) -> None:
    journal, url = agent
    poller = JournalPoller(log, interval=0.05)
    journal.add("process.start", pid=1, cmd="true", args=[])
    await poller.track("s1", url, TOKEN)
    assert await poller.pull_now("s1") == 1
    await poller.start()
    journal.add("process.exit", pid=1, exitCode=0, status="exit status 0")
    for _ in range(200):  # bounded wait for the background round, not a timing assertion
        if len(await log.read("s1")) == 2:
            break
        await asyncio.sleep(0.02)
    assert [e.kind for e in await log.read("s1")] == ["process.start", "process.exit"]
    journal.fail = True
    await poller.poll_once()  # a failing agent is logged and backed off, not raised
    poller.untrack("s1")
    assert poller.tracked() == []
    # on resume from a checkpoint the cursor goes back to the checkpoint's
    journal.fail = False
    await poller.track("s1", url, TOKEN, cursor=1)
    assert await poller.pull_now("s1") == 2
    assert [e.kind for e in await log.read("s1")] == ["process.start", "process.exit", "process.exit"]
    await poller.stop()


async def test_a_restarted_agent_journal_is_read_from_its_start(agent: tuple[FakeJournal, str], log: EventLog) -> None:
    journal, url = agent
    for i in range(3):
        journal.add("dir.make", path=f"/old{i}")
    async with aiohttp.ClientSession() as http:
        assert await pull_journal(log, "s1", url, TOKEN, 0, http) == 3
        journal.entries.clear()  # the agent restarted: a new, empty journal
        journal.add("dir.make", path="/new")
        assert await pull_journal(log, "s1", url, TOKEN, 3, http) == 1
    events = await log.read("s1")
    assert [e.kind for e in events[3:]] == ["journal.reset", "dir.make"]
    assert events[3].data == {"cursor": 3, "last": 1} and events[4].data["path"] == "/new"


async def test_no_pull_runs_while_a_session_is_held(agent: tuple[FakeJournal, str], log: EventLog) -> None:
    """A checkpoint holds the session: the background poller and on-demand pulls wait for the hold's end."""
    journal, url = agent
    poller = JournalPoller(log, interval=0.01)
    journal.add("process.start", pid=1, cmd="true", args=[])
    await poller.track("s1", url, TOKEN)
    await poller.start()
    try:
        async with poller.hold("s1"):
            before = len(journal.requests)
            pending = asyncio.create_task(poller.pull_now("s1"))
            # Not a wait for anything: rounds (poll_once, the background poller every 0.01 s, `pending`) in which a
            # pull that ignored the hold would show. What is checked is an absence.
            for _ in range(20):
                await poller.poll_once()
                await asyncio.sleep(0.01)
            assert len(journal.requests) == before
            assert not pending.done()
        assert await pending == 1
        assert len(journal.requests) > before
    finally:
        await poller.stop()
