"""The gateway's ledger on SQLite and PostgreSQL: runs and bindings, marks, positions, calls billed exactly once,
budgets that two racing reservations never overspend, recovery of a dead owner's calls."""

from __future__ import annotations

import asyncio
import time

import pytest
import sqlalchemy as sa

from keepstate.db.engine import Database
from keepstate.db.repos import Ledger
from keepstate.db.repos.ledger import Attempt, BudgetRefused, CallInFlight, Mark, Position, Run

from .race import HeldCommit, race

RUN = Run(run_id="run_1", session_id="sess", sandbox_id="sbx", api_key_id="key", checkpoint_id=None, mode="diverge",
          parent_session_id=None)
ME, OTHER, DEAD = "100:aaaa", "200:bbbb", "300:dead"


def attempt(key: str, run: Run = RUN) -> Attempt:
    return Attempt(call_key=key, run=run, provider="p", model="gpt-4o", endpoint="chat", started_at=time.time())


def pos(ordinal: int, key: str = "", body: str = "", **kw: object) -> Position:
    return Position(run_id=RUN.run_id, ordinal=ordinal, call_key=key or f"k{ordinal}", body_hash=body or f"h{ordinal}",
                    source="upstream", delivered=False, **kw)  # type: ignore[arg-type]


async def finish(ledger: Ledger, key: str, cost: int = 10, ok: bool = True) -> int | None:
    return await ledger.finish_upstream(attempt(key), ok=ok, outcome="ok" if ok else "error", http_status=200,
                                        content_type="application/json", response=b'{"x": 1}\x00',
                                        usage={"input_tokens": 3, "output_tokens": 2}, request_id="req-1",
                                        cost_nano=cost, priced=True)


async def test_runs_bindings_and_lineage(database: Database) -> None:
    ledger = Ledger(database, ME)
    await ledger.create_run(RUN, "h1")
    assert await ledger.run("run_1") == RUN and await ledger.run_by_token_hash("h1") == RUN
    assert await ledger.run("nope") is None and await ledger.run_by_token_hash("nope") is None
    child = Run(run_id="run_2", session_id="child", sandbox_id="sbx2", api_key_id=None, checkpoint_id="ck",
                mode="replay", parent_session_id="sess", source_ip="10.88.0.2")
    await ledger.create_run(child, "h2", "10.88.0.2")
    await ledger.create_run(Run(run_id="run_3", session_id="child", sandbox_id="sbx2", api_key_id=None,
                                checkpoint_id="ck2", mode="diverge", parent_session_id=None), "h3")
    assert await ledger.parent_session("child") == "sess" and await ledger.parent_session("sess") is None
    assert await ledger.bound_run("10.88.0.2") == child and await ledger.bindings() == {"10.88.0.2": "run_2"}
    active = await ledger.active_run("child")
    assert active is not None and active.run_id == "run_3"
    await ledger.set_aligned("run_2", 4)
    await ledger.set_aligned("run_2", 7)  # the first alignment stays
    got = await ledger.run("run_2")
    assert got is not None and got.aligned_at == 4
    assert not await ledger.run_ended("run_2") and await ledger.run_ended("nope")
    await ledger.end_run("run_2")
    assert await ledger.run_ended("run_2") and await ledger.bound_run("10.88.0.2") is None
    assert await ledger.bindings() == {}
    ended = await ledger.run("run_2")
    assert ended is not None and ended.ended


async def test_caller_reads_the_binding_and_the_end_in_one_go(database: Database) -> None:
    ledger = Ledger(database, ME)
    bound = Run(run_id="run_b", session_id="s", sandbox_id="x", api_key_id=None, checkpoint_id=None, mode="diverge",
                parent_session_id=None, source_ip="10.88.0.9")
    await ledger.create_run(RUN, "h1")
    await ledger.create_run(bound, "hb", "10.88.0.9")
    assert await ledger.caller("10.88.0.9", "run_1") == (bound, False)
    assert await ledger.caller("127.0.0.1", "run_1") == (None, False)
    assert await ledger.caller(None, None) == (None, True)
    assert await ledger.caller(None, "nope") == (None, True)  # an unknown run counts as ended
    await ledger.end_run("run_b")
    await ledger.end_run("run_1")
    assert await ledger.caller("10.88.0.9", "run_1") == (None, True)


async def test_existing_budgets_in_their_order(database: Database) -> None:
    ledger = Ledger(database, ME)
    await ledger.set_budget("key", "k1", 100)
    await ledger.set_budget("session", "s1", 100)
    scopes = [("session", "s1"), ("key", "k2"), ("key", "k1")]
    assert await ledger.existing_budgets(scopes) == [("session", "s1"), ("key", "k1")]
    assert await ledger.existing_budgets([]) == []


async def test_a_binding_follows_the_latest_registration(database: Database) -> None:
    ledger = Ledger(database, ME)
    for run_id, session in (("a", "s1"), ("b", "s2")):
        await ledger.create_run(Run(run_id=run_id, session_id=session, sandbox_id="x", api_key_id=None,
                                    checkpoint_id=None, mode="diverge", parent_session_id=None), "h" + run_id,
                                "10.88.0.2")
    assert await ledger.bindings() == {"10.88.0.2": "b"}
    await ledger.end_run("a")  # ending a superseded run leaves the address to its new owner
    assert await ledger.bindings() == {"10.88.0.2": "b"}


async def test_marks_positions_and_divergences(database: Database) -> None:
    ledger = Ledger(database, ME)
    await ledger.create_run(RUN, "h")
    assert await ledger.next_ordinal("run_1") == 0
    await ledger.add_position(pos(0, arrived_at=1.0))
    await ledger.add_position(Position(run_id="run_1", ordinal=1, call_key="k1", body_hash="h0", source="store",
                                       delivered=True, arrived_at=2.0))
    with pytest.raises(sa.exc.IntegrityError):
        await ledger.add_position(pos(1))
    assert await ledger.next_ordinal("run_1") == 2
    first, second = await ledger.positions("run_1")
    assert (first.delivered, first.delivered_at, second.delivered_at) == (False, None, 2.0)
    await ledger.set_delivered("run_1", 0)
    delivered = await ledger.position("run_1", 0)
    assert delivered is not None and delivered.delivered and delivered.delivered_at is not None
    latest = await ledger.latest_position_with_hash("run_1", "h0")
    assert latest is not None and latest.ordinal == 1
    assert await ledger.latest_position_with_hash("run_1", "zz") is None and await ledger.position("run_1", 9) is None

    await ledger.put_mark(Mark(checkpoint_id="ck", session_id="sess", run_id="run_1", position=1))
    await ledger.put_mark(Mark(checkpoint_id="ck", session_id="sess", run_id="run_1", position=2, last_position=3))
    assert await ledger.mark("ck") == Mark(checkpoint_id="ck", session_id="sess", run_id="run_1", position=2,
                                           last_position=3)
    assert await ledger.mark("nope") is None and [m.checkpoint_id for m in await ledger.marks_of_run("run_1")] == ["ck"]

    await ledger.record_divergence("run_1", 5, first, "other")
    (div,) = await ledger.divergences("run_1")
    assert (div["ordinal"], div["expected_call_key"], div["expected_hash"], div["got_hash"]) == (5, "k0", "h0", "other")
    assert await ledger.divergences("nope") == [] and len(await ledger.divergences()) == 1


async def test_begin_and_finish_store_the_answer_and_bill_once(database: Database) -> None:
    ledger = Ledger(database, ME)
    await ledger.create_run(RUN, "h")
    await ledger.set_budget("session", "sess", 100)
    await ledger.begin_upstream(attempt("k1"), True, "h1", pos(0, "k1"), [("session", "sess"), ("key", "none")], 60)
    call = await ledger.call("k1")
    assert call is not None and (call.status, call.owner, call.stream) == ("inflight", ME, True)
    assert await ledger.any_inflight() and [p.call_key for p in await ledger.positions("run_1")] == ["k1"]
    with pytest.raises(CallInFlight):
        await Ledger(database, OTHER).begin_upstream(attempt("k1"), True, "h1", None, [], 0)
    entry_id = await finish(ledger, "k1")
    assert entry_id is not None
    assert await finish(ledger, "k1") is None  # a second finish is a no-op that says so
    assert await Ledger(database, OTHER).finish_upstream(
        attempt("k1"), ok=True, outcome="ok", http_status=200, content_type=None, response=b"", usage=None,
        request_id=None, cost_nano=99, priced=True) is None
    call = await ledger.call("k1")
    assert call is not None and (call.status, call.owner, call.ok_entry_id, call.http_status) == (
        "done", None, entry_id, 200)
    assert (call.response, call.usage, call.upstream_request_id) == (b'{"x": 1}\x00', {"input_tokens": 3,
                                                                                        "output_tokens": 2}, "req-1")
    (entry,) = await ledger.entries()
    assert (entry["entry_id"], entry["kind"], entry["outcome"], entry["cost_nano"], entry["input_tokens"],
            entry["output_tokens"], entry["priced"]) == (entry_id, "upstream", "ok", 10, 3, 2, 1)
    budget = await ledger.budget("session", "sess")
    assert budget is not None and (budget["spent_nano"], budget["reserved_nano"]) == (10, 0)
    assert not await ledger.any_inflight()

    served = await ledger.record_served("store", attempt("k1"), entry_id, 200)
    assert served > entry_id
    assert [(e["kind"], e["cost_nano"], e["original_entry_id"]) for e in await ledger.entries("sess")][1:] == [
        ("store", 0, entry_id)]
    assert await ledger.entries("other") == []


async def test_a_failed_call_can_be_tried_again(database: Database) -> None:
    ledger = Ledger(database, ME)
    await ledger.create_run(RUN, "h")
    await ledger.begin_upstream(attempt("k1"), False, "h1", None, [], 0)
    await finish(ledger, "k1", cost=0, ok=False)
    failed = await ledger.call("k1")
    assert failed is not None and failed.status == "failed" and failed.ok_entry_id is None
    await ledger.begin_upstream(attempt("k1"), False, "h1", None, [], 0)
    again = await ledger.call("k1")
    assert again is not None and (again.status, again.response, again.usage) == ("inflight", None, None)
    entry_id = await finish(ledger, "k1")
    done = await ledger.call("k1")
    assert done is not None and done.status == "done" and done.ok_entry_id == entry_id
    assert [e["outcome"] for e in await ledger.entries()] == ["error", "ok"]


async def test_a_refused_reservation_writes_nothing(database: Database, other_database: Database) -> None:
    a, b = Ledger(database, ME), Ledger(other_database, OTHER)
    await a.create_run(RUN, "h")
    await a.set_budget("session", "sess", 100)
    await a.set_budget("key", "key", 1000)
    await a.begin_upstream(attempt("k1"), False, "h1", None, [("key", "key"), ("session", "sess")], 60)
    with pytest.raises(BudgetRefused) as refused:
        await b.begin_upstream(attempt("k2"), False, "h2", pos(1, "k2"), [("key", "key"), ("session", "sess")], 60)
    assert (refused.value.scope, refused.value.ident) == ("session", "sess")
    assert await b.call("k2") is None and await b.positions("run_1") == []
    key_budget = await b.budget("key", "key")
    assert key_budget is not None and key_budget["reserved_nano"] == 60  # the key's reservation was rolled back
    await finish(a, "k1")
    await b.begin_upstream(attempt("k2"), False, "h2", None, [("session", "sess")], 60)
    assert [(x["scope"], x["spent_nano"], x["reserved_nano"]) for x in await b.budgets()] == [
        ("key", 10, 0), ("session", 10, 60)]
    await a.set_budget("session", "sess", 500)  # a new limit keeps what was spent and reserved
    changed = await a.budget("session", "sess")
    assert changed is not None and (changed["limit_nano"], changed["spent_nano"], changed["reserved_nano"]) == (
        500, 10, 60)


async def test_two_racing_reservations_never_overspend(database: Database, held_database: HeldCommit) -> None:
    await Ledger(database, ME).create_run(RUN, "h")
    await Ledger(database, ME).set_budget("session", "sess", 100)
    outcomes = await race(
        held_database,
        lambda: Ledger(held_database, ME).begin_upstream(attempt("k1"), False, "h1", None, [("session", "sess")], 60),
        lambda: Ledger(database, OTHER).begin_upstream(attempt("k2"), False, "h2", None, [("session", "sess")], 60))
    assert outcomes[0] is None and isinstance(outcomes[1], BudgetRefused)
    budget = await Ledger(database, ME).budget("session", "sess")
    assert budget is not None and budget["reserved_nano"] == 60
    assert await Ledger(database, ME).call("k2") is None


async def test_many_concurrent_reservations_never_overspend(database: Database) -> None:
    others = [await Database.open(database.url) for _ in range(3)]
    try:
        await Ledger(database, ME).create_run(RUN, "h")
        await Ledger(database, ME).set_budget("session", "sess", 100)
        ledgers = [Ledger(db, f"{n}:x") for n, db in enumerate([database, *others])]
        outcomes = await asyncio.gather(
            *(ledgers[n % 4].begin_upstream(attempt(f"k{n}"), False, f"h{n}", None, [("session", "sess")], 30)
              for n in range(12)), return_exceptions=True)
        assert sum(o is None for o in outcomes) == 3 and all(
            o is None or isinstance(o, BudgetRefused) for o in outcomes)
        budget = await ledgers[0].budget("session", "sess")
        assert budget is not None and budget["reserved_nano"] == 90
    finally:
        for db in others:
            await db.close()


async def test_two_racing_claims_of_one_call_one_is_in_flight(database: Database, held_database: HeldCommit) -> None:
    await Ledger(database, ME).create_run(RUN, "h")
    outcomes = await race(
        held_database,
        lambda: Ledger(held_database, ME).begin_upstream(attempt("k1"), False, "h1", None, [], 0),
        lambda: Ledger(database, OTHER).begin_upstream(attempt("k1"), False, "h1", None, [], 0))
    assert outcomes[0] is None and isinstance(outcomes[1], CallInFlight)
    call = await Ledger(database, ME).call("k1")
    assert call is not None and call.owner == ME


async def test_a_call_finished_twice_at_once_is_billed_once(database: Database, held_database: HeldCommit) -> None:
    ledger = Ledger(database, ME)
    await ledger.create_run(RUN, "h")
    await ledger.set_budget("session", "sess", 100)
    await ledger.begin_upstream(attempt("k1"), False, "h1", None, [("session", "sess")], 60)
    outcomes = await race(held_database, lambda: finish(Ledger(held_database, ME), "k1"),
                          lambda: finish(ledger, "k1"))
    assert isinstance(outcomes[0], int) and outcomes[1] is None
    assert len(await ledger.entries()) == 1
    budget = await ledger.budget("session", "sess")
    assert budget is not None and (budget["spent_nano"], budget["reserved_nano"]) == (10, 0)


async def test_recover_bills_a_dead_owners_call_once(database: Database, other_database: Database) -> None:
    dead = Ledger(database, DEAD)
    await dead.create_run(RUN, "h")
    await dead.set_budget("key", "key", 1000)
    await dead.begin_upstream(attempt("k1"), True, "h1", None, [("key", "key")], 300)
    mine = Ledger(database, ME)
    await mine.begin_upstream(attempt("k2"), True, "h2", None, [("key", "key")], 300)

    def alive(owner: str) -> bool:
        return owner != DEAD

    # two servers recovering at once: each call is interrupted and billed by one of them
    found = await asyncio.gather(mine.recover(alive), Ledger(other_database, OTHER).recover(alive))
    assert sorted(found, key=len) == [[], ["k1"]]
    call = await mine.call("k1")
    assert call is not None and (call.status, call.owner) == ("interrupted", None)
    (entry,) = await mine.entries()
    assert (entry["kind"], entry["outcome"], entry["call_key"], entry["sandbox_id"], entry["api_key_id"]) == (
        "upstream", "interrupted", "k1", "sbx", "key")
    budget = await mine.budget("key", "key")
    assert budget is not None and (budget["spent_nano"], budget["reserved_nano"]) == (300, 300)  # k2's still held
    assert await mine.recover(alive) == []
    assert await dead.finish_upstream(attempt("k1"), ok=True, outcome="ok", http_status=200, content_type=None,
                                      response=b"", usage=None, request_id=None, cost_nano=5, priced=True) is None
    assert len(await mine.entries()) == 1  # the late finish of the recovered call billed nothing
    await mine.begin_upstream(attempt("k1"), True, "h1", None, [("key", "key")], 300)  # tried again, anew
    again = await mine.call("k1")
    assert again is not None and again.status == "inflight"
