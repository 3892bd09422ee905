"""Sandboxes on SQLite and PostgreSQL: conditional transitions (Stale, Fenced) under real races, the atomic claim of a
pooled row, and a row's deletion and its teardown written together or not at all."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import sqlalchemy as sa

from keepstate.db.engine import Database
from keepstate.db.errors import Fenced, Stale
from keepstate.db.records import SandboxRecord, TeardownRecord
from keepstate.db.repos import Sandboxes
from keepstate.errors import Conflict, NotFound

from .race import HeldCommit, race


def sandbox(sandbox_id: str, state: str = "running", **changes: object) -> SandboxRecord:
    rec = SandboxRecord(sandbox_id=sandbox_id, state=state, template_id="base", template_digest="sha256:d",
                        runtime_name=f"ks-{sandbox_id}", slot=3, address="10.88.0.14", access_token="tok",
                        started_at=100.0, end_at=400.0, cpu=2.0, memory_mb=512, api_key_id="key_1",
                        doc='{"session_id": "x", "metadata": {"a": "b"}}', node_id="local")
    return dataclasses.replace(rec, **changes)  # type: ignore[arg-type]


async def test_insert_get_and_list(database: Database) -> None:
    sandboxes = Sandboxes(database)
    a = sandbox("a", epoch=2, version=7, api_key_id=None, cpu=0.5)
    b = sandbox("b", state="paused", started_at=50.0, slot=-1)
    c = sandbox("c", node_id="node-2", slot=9)
    for rec in (a, b, c):
        await sandboxes.insert(rec)
    assert await sandboxes.get("a") == a and await sandboxes.get("nope") is None
    assert await sandboxes.list("local") == [b, a]  # oldest first
    assert await sandboxes.list("local", states=["running"]) == [a]
    assert await sandboxes.list("local", states=("running", "paused", "pooled")) == [b, a]
    assert await sandboxes.list("local", states=[]) == []
    assert await sandboxes.list("node-2") == [c]
    assert await sandboxes.used_slots("local") == {3} and await sandboxes.used_slots("node-2") == {9}


async def test_insert_refuses_a_duplicate_id(database: Database) -> None:
    sandboxes = Sandboxes(database)
    await sandboxes.insert(sandbox("a"))
    with pytest.raises(Conflict, match="sandbox a exists"):
        await sandboxes.insert(sandbox("a", state="paused"))
    assert await sandboxes.get("a") == sandbox("a")


async def test_transition_is_conditioned_on_version_and_epoch(database: Database) -> None:
    sandboxes = Sandboxes(database)
    await sandboxes.insert(sandbox("a", epoch=1))
    assert await sandboxes.transition("a", 0, 1, state="pausing") == 1
    assert await sandboxes.transition("a", 1, 1, state="paused", end_at=0.0, doc="{}") == 2
    assert await sandboxes.get("a") == sandbox("a", epoch=1, version=2, state="paused", end_at=0.0, doc="{}")
    with pytest.raises(Stale, match="at version 2, not 1"):
        await sandboxes.transition("a", 1, 1, state="running")
    with pytest.raises(Fenced, match="at epoch 1, not 0"):
        await sandboxes.transition("a", 2, 0, state="running")
    with pytest.raises(Fenced):  # both moved: the epoch is what matters
        await sandboxes.transition("a", 0, 0, state="running")
    with pytest.raises(NotFound):
        await sandboxes.transition("nope", 0, 0, state="running")
    assert (await sandboxes.get("a")).state == "paused"  # type: ignore[union-attr]
    assert await sandboxes.transition("a", 2, 1) == 3  # no change but the version: a touch


@pytest.mark.parametrize("column", ["version", "epoch", "sandbox_id", "no_such_column"])
async def test_transition_refuses_what_it_does_not_change(database: Database, column: str) -> None:
    sandboxes = Sandboxes(database)
    await sandboxes.insert(sandbox("a"))
    with pytest.raises(TypeError, match=column):
        await sandboxes.transition("a", 0, 0, **{column: 5})
    assert await sandboxes.get("a") == sandbox("a")


async def test_a_transition_records_its_teardown_only_if_it_happens(database: Database) -> None:
    sandboxes = Sandboxes(database)
    await sandboxes.insert(sandbox("a"))
    with pytest.raises(Stale):
        await sandboxes.transition("a", 5, 0, state="paused", teardown=TeardownRecord(runtime_name="ks-x", slot=4))
    assert await sandboxes.teardowns("local") == []
    await sandboxes.transition("a", 0, 0, state="paused", teardown=TeardownRecord(runtime_name="ks-a", slot=3))
    assert [(t.runtime_name, t.slot) for t in await sandboxes.teardowns("local")] == [("ks-a", 3)]


async def test_two_racing_transitions_one_wins_the_other_is_stale(database: Database,
                                                                  held_database: HeldCommit) -> None:
    await Sandboxes(database).insert(sandbox("a"))
    outcomes = await race(held_database,
                          lambda: Sandboxes(held_database).transition("a", 0, 0, state="pausing"),
                          lambda: Sandboxes(database).transition("a", 0, 0, state="killing"))
    assert outcomes[0] == 1 and isinstance(outcomes[1], Stale)
    got = await Sandboxes(database).get("a")
    assert got is not None and (got.state, got.version) == ("pausing", 1)


async def test_many_racing_transitions_one_wins(database: Database) -> None:
    servers = [database] + [await Database.open(database.url) for _ in range(3)]
    try:
        await Sandboxes(database).insert(sandbox("a"))
        outcomes = await asyncio.gather(*(Sandboxes(db).transition("a", 0, 0, state=f"s{i}")
                                          for i, db in enumerate(servers)), return_exceptions=True)
        assert outcomes.count(1) == 1 and all(isinstance(o, Stale) for o in outcomes if o != 1)
        got = await Sandboxes(database).get("a")
        assert got is not None and (got.state, got.version) == (f"s{outcomes.index(1)}", 1)
    finally:
        for db in servers[1:]:
            await db.close()


async def test_a_fenced_owner_writes_nothing_while_the_new_one_moves_on(database: Database,
                                                                        other_database: Database) -> None:
    old, new = Sandboxes(database), Sandboxes(other_database)
    await old.insert(sandbox("a"))
    async with other_database.transaction() as conn:  # issue 27: the new owner bumps the epoch when it takes over
        await conn.execute(sa.text("UPDATE sandboxes SET epoch = epoch + 1, version = version + 1, node_id = 'n2'"))
    with pytest.raises(Fenced):
        await old.transition("a", 0, 0, state="killing")
    with pytest.raises(Fenced):
        await old.delete("a", TeardownRecord(runtime_name="ks-a", slot=3), expect_version=1, expect_epoch=0)
    assert await new.transition("a", 1, 1, state="paused") == 2
    assert await old.teardowns("local") == []


async def test_claim_pooled_moves_the_row(database: Database) -> None:
    sandboxes = Sandboxes(database)
    await sandboxes.insert(sandbox("pool-1", state="pooled", access_token=""))
    mine = sandbox("mine", runtime_name="ks-pool-1")
    await sandboxes.claim_pooled("pool-1", mine)
    assert await sandboxes.get("pool-1") is None and await sandboxes.get("mine") == mine
    with pytest.raises(Stale, match="pool-1"):  # claimed already
        await sandboxes.claim_pooled("pool-1", sandbox("yours"))
    with pytest.raises(Stale):  # a row that is not pooled is not claimed
        await sandboxes.claim_pooled("mine", sandbox("yours"))
    assert await sandboxes.get("yours") is None and await sandboxes.get("mine") == mine


async def test_claim_pooled_under_a_taken_id_changes_nothing(database: Database) -> None:
    sandboxes = Sandboxes(database)
    pooled = sandbox("pool-1", state="pooled")
    await sandboxes.insert(pooled)
    await sandboxes.insert(sandbox("mine"))
    with pytest.raises(Conflict):
        await sandboxes.claim_pooled("pool-1", sandbox("mine", state="paused"))
    assert await sandboxes.get("pool-1") == pooled and await sandboxes.get("mine") == sandbox("mine")


async def test_two_racing_claims_of_one_pooled_row_one_wins(database: Database, held_database: HeldCommit) -> None:
    await Sandboxes(database).insert(sandbox("pool-1", state="pooled"))
    outcomes = await race(held_database,
                          lambda: Sandboxes(held_database).claim_pooled("pool-1", sandbox("alice")),
                          lambda: Sandboxes(database).claim_pooled("pool-1", sandbox("bob")))
    assert outcomes[0] is None and isinstance(outcomes[1], Stale)
    rows = await Sandboxes(database).list("local")
    assert [r.sandbox_id for r in rows] == ["alice"]


async def test_delete_records_the_teardown_with_it(database: Database) -> None:
    sandboxes = Sandboxes(database)
    await sandboxes.insert(sandbox("a"))
    assert await sandboxes.delete("a", TeardownRecord(runtime_name="ks-a", slot=3, next_try=5.0)) is True
    assert await sandboxes.get("a") is None
    [torn] = await sandboxes.teardowns("local")
    assert (torn.runtime_name, torn.slot, torn.attempts, torn.next_try, torn.last_error) == ("ks-a", 3, 0, 5.0, "")
    assert torn.created_at > 0
    assert await sandboxes.delete("a") is False  # gone already
    await sandboxes.insert(sandbox("b"))
    assert await sandboxes.delete("b") is True and len(await sandboxes.teardowns("local")) == 1  # no teardown given


async def test_a_teardown_recorded_twice_keeps_its_attempts(database: Database) -> None:
    """As the catalog's put_teardown: a kill retried after a failed teardown does not reset its schedule."""
    sandboxes = Sandboxes(database)
    await sandboxes.add_teardown(TeardownRecord(runtime_name="ks-a", slot=3))
    assert await sandboxes.teardown_failed("ks-a", "busy", 50.0) == 1
    await sandboxes.insert(sandbox("a"))
    assert await sandboxes.delete("a", TeardownRecord(runtime_name="ks-a", slot=3)) is True
    [torn] = await sandboxes.teardowns("local")
    assert (torn.attempts, torn.next_try, torn.last_error) == (1, 50.0, "busy")


async def test_delete_conditioned_on_a_version(database: Database) -> None:
    sandboxes = Sandboxes(database)
    await sandboxes.insert(sandbox("a", version=4))
    with pytest.raises(Stale):
        await sandboxes.delete("a", TeardownRecord(runtime_name="ks-a", slot=3), expect_version=3)
    assert await sandboxes.get("a") is not None and await sandboxes.teardowns("local") == []
    with pytest.raises(NotFound):
        await sandboxes.delete("nope", expect_version=0)
    assert await sandboxes.delete("a", TeardownRecord(runtime_name="ks-a", slot=3), expect_version=4,
                                  expect_epoch=0) is True


async def _refuse(database: Database, table: str, when: str, name: str) -> None:
    """A trigger that makes the database refuse one statement, as a fault in the middle of a transaction."""
    async with database.transaction() as conn:
        if database.kind == "sqlite":
            await conn.execute(sa.text(f"CREATE TRIGGER {name} BEFORE {when} ON {table} FOR EACH ROW "
                                       f"BEGIN SELECT RAISE(ABORT, 'refused by {name}'); END"))
        else:
            await conn.execute(sa.text(f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS "
                                       f"$$ BEGIN RAISE EXCEPTION 'refused by {name}'; END $$"))
            await conn.execute(sa.text(f"CREATE TRIGGER {name} BEFORE {when} ON {table} FOR EACH ROW "
                                       f"EXECUTE FUNCTION {name}()"))


async def test_delete_keeps_the_row_when_its_teardown_cannot_be_written(database: Database) -> None:
    sandboxes = Sandboxes(database)
    await sandboxes.insert(sandbox("a"))
    await _refuse(database, "teardowns", "INSERT", "no_teardown")
    with pytest.raises(sa.exc.DBAPIError, match="refused by no_teardown"):
        await sandboxes.delete("a", TeardownRecord(runtime_name="ks-a", slot=3))
    assert await sandboxes.get("a") == sandbox("a") and await sandboxes.teardowns("local") == []


async def test_delete_records_no_teardown_when_the_row_cannot_be_deleted(database: Database) -> None:
    sandboxes = Sandboxes(database)
    await sandboxes.insert(sandbox("a"))
    await _refuse(database, "sandboxes", "DELETE", "no_delete")
    with pytest.raises(sa.exc.DBAPIError, match="refused by no_delete"):
        await sandboxes.delete("a", TeardownRecord(runtime_name="ks-a", slot=3))
    assert await sandboxes.get("a") == sandbox("a") and await sandboxes.teardowns("local") == []


async def test_teardowns_retry_and_finish(database: Database) -> None:
    sandboxes = Sandboxes(database)
    for name, next_try in (("ks-late", 30.0), ("ks-due", 10.0), ("ks-now", 0.0)):
        await sandboxes.add_teardown(TeardownRecord(runtime_name=name, slot=1, next_try=next_try))
    assert [t.runtime_name for t in await sandboxes.teardowns("local")] == ["ks-now", "ks-due", "ks-late"]
    assert await sandboxes.teardown_failed("ks-now", "x" * 5000, 60.0) == 1
    assert await sandboxes.teardown_failed("ks-now", "still busy", 90.0) == 2
    assert await sandboxes.teardown_failed("ks-nope", "?", 1.0) is None
    by_name = {t.runtime_name: t for t in await sandboxes.teardowns("local")}
    assert (by_name["ks-now"].attempts, by_name["ks-now"].next_try, by_name["ks-now"].last_error) == \
        (2, 90.0, "still busy")
    await sandboxes.teardown_failed("ks-due", "y" * 5000, 20.0)
    assert [t.runtime_name for t in await sandboxes.teardowns("local")] == ["ks-due", "ks-late", "ks-now"]
    assert (await sandboxes.teardowns("local"))[0].last_error == "y" * 2000
    assert await sandboxes.delete_teardown("ks-due") is True and await sandboxes.delete_teardown("ks-due") is False
    assert [t.runtime_name for t in await sandboxes.teardowns("local")] == ["ks-late", "ks-now"]


async def test_a_node_sees_only_its_own_hosts_teardowns(database: Database) -> None:
    """Two nodes on one database: each one's teardown loop takes only the instances its own host holds."""
    sandboxes = Sandboxes(database)
    await sandboxes.add_teardown(TeardownRecord(runtime_name="ks-here", slot=1))
    await sandboxes.add_teardown(TeardownRecord(runtime_name="ks-there", slot=1, node_id="b"))
    assert [t.runtime_name for t in await sandboxes.teardowns("local")] == ["ks-here"]
    assert [(t.runtime_name, t.node_id) for t in await sandboxes.teardowns("b")] == [("ks-there", "b")]


async def test_a_paused_sandbox_of_a_gone_node_is_taken_over_once(database: Database) -> None:
    """take_over moves a paused row only from a node that is not live, bumps its epoch (the old owner is fenced),
    and only once: a second taker, or a running sandbox, gets nothing."""
    from keepstate.db.records import NodeRecord
    from keepstate.db.repos import Nodes

    nodes, sandboxes = Nodes(database), Sandboxes(database)
    a = await nodes.join(NodeRecord(node_id="a", address="http://a", cpus=1, memory_mb=1, max_sandboxes=1,
                                    runsc_release="r"), ttl_s=60)
    await sandboxes.insert(sandbox("p", "paused", node_id="a"))
    await sandboxes.insert(sandbox("r", "running", node_id="a"))
    assert await sandboxes.take_over("p", "b") is None  # a is live
    assert await nodes.leave("a", a.incarnation)
    moved = await sandboxes.take_over("p", "b")
    assert moved is not None and (moved.node_id, moved.state, moved.epoch, moved.version) == ("b", "paused", 1, 1)
    assert await sandboxes.take_over("p", "c") is None  # b's now, and b is not gone
    assert await sandboxes.take_over("r", "b") is None  # running: it needs a checkpoint policy to move (not yet)
    with pytest.raises(Fenced):
        await sandboxes.transition("p", 0, 0, state="running")  # the old owner's last view
    assert [s.sandbox_id for s in await sandboxes.list("b")] == ["p"]
