"""SessionRecorder: a whole session lifecycle, with the journal pulled from a fake agent."""

from __future__ import annotations

from keepstate.session import EventLog, JournalPoller, Lineage, SessionRecorder
from tests.session.conftest import TOKEN, FakeJournal


async def test_lifecycle_keeps_log_lineage_and_journal_in_step(agent: tuple[FakeJournal, str], log: EventLog,
                                                               lineage: Lineage) -> None:
    journal, url = agent
    poller = JournalPoller(log)
    rec = SessionRecorder(log, lineage, poller)
    await rec.created("isbx", "base", "sha256:00", {"a": "b"}, 300, agent_url=url, token=TOKEN)
    journal.add("process.start", pid=9, cmd="/bin/bash", args=["-c", "sleep 1"])

    ref = await rec.checkpoint_begin("isbx", "cp1", None, "pause")
    history = await log.read("isbx")
    assert [e.kind for e in history] == ["sandbox.create", "process.start", "checkpoint"]
    assert (ref.seq, ref.hash) == (3, history[2].hash) and history[2].data["journal_cursor"] == 1
    await rec.checkpoint_published("isbx", "cp1", None, "pause", ref)
    await rec.paused("isbx", "cp1", True)
    assert poller.tracked() == [] and (await lineage.session("isbx")).state == "paused"  # type: ignore[union-attr]

    await rec.resumed("isbx", "cp1", "host-b", agent_url=url, token=TOKEN)
    journal.add("process.exit", pid=9, exitCode=0, status="exit status 0")
    await poller.pull_now("isbx")
    assert (await log.head("isbx")).kind == "process.exit"  # type: ignore[union-attr]

    first = await rec.forked("isbx", "ifork", "cp1", agent_url=url, token=TOKEN)
    assert first.data["parent_event"] == {"seq": ref.seq, "hash": ref.hash}
    # the child's agent was restored at the checkpoint: it sees the exit (agent seq 2) as new, once
    await poller.pull_now("ifork")
    assert [e.kind for e in await log.read("ifork")] == ["session.fork", "process.exit"]
    await rec.killed("ifork", "user")
    assert (await log.verify("isbx")).ok and (await log.verify("ifork")).ok
    tree = (await lineage.tree("ifork"))["root"]
    assert tree["checkpoints"][0]["forks"][0]["sessionId"] == "ifork"
    assert tree["checkpoints"][0]["forks"][0]["state"] == "killed"
    await poller.stop()
