"""The metering gateway's ledger (docs/design/database.md, "Ledger"; docs/design/gateway.md): runs and their
address bindings, checkpoint marks, positions, divergences, calls, budgets and ledger entries.

    ledger = Ledger(db, owner="node/a/3")            # the owner written on the calls it claims (ledger_claims.py)
    await ledger.begin_upstream(attempt, ...)        # reserve, record the position, mark the call in flight
    entry_id = await ledger.finish_upstream(attempt, ...)   # bill it, once (None: it was finished already)
    await ledger.recover(alive)                      # the calls of gone owners: interrupted, billed once

Promises:
- `begin_upstream` reserves every applicable budget, records the call's position and marks the call `inflight` in
  one transaction; a budget that the reservation would overrun refuses it (BudgetRefused) and nothing is written.
  The reservation is a conditional UPDATE (`… WHERE spent + reserved + amount <= limit`), so two calls reserving at
  once never overspend a budget, on PostgreSQL too. A call in flight is not claimed again (CallInFlight) unless
  its owner is gone (`alive` given): then, in the same transaction, that owner's attempt is interrupted as by
  `recover` and the call claimed anew; of two claims at once (two nodes retrying it) exactly one succeeds.
- `finish_upstream` bills the call once: it only finishes a call that is in flight and owned by this ledger's
  owner; a second finish (or a finish after `recover` took the call) writes nothing and returns None.
- `recover` turns every in-flight call whose owner is gone into `interrupted`, with one ledger entry and its whole
  reservation charged (the provider may have billed it), in one transaction; two recoveries at once bill each call
  once.

No domain types: usage is a plain mapping of token counts (stored as JSON in `calls.usage`), ledger entries,
budgets and divergences are their rows as dicts (column name -> value). Owners are opaque strings: a node's
incarnation (`node/<node>/<incarnation>`) is judged gone by the `nodes` table, any other owner by the caller's
`alive` (the `pid:nonce` of a standalone gateway process): keepstate/db/repos/ledger_claims.py.
"""

from __future__ import annotations

import builtins
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Row

from keepstate.db.engine import Conn, Database
from keepstate.db.repos._sql import duplicate, upsert
from keepstate.db.repos.ledger_claims import existing_budgets, gone_judge, owner_gone, reserve, settle
from keepstate.db.schema import bindings, budgets, calls, divergences, ledger, marks, positions, runs

TOKEN_FIELDS = ("input_tokens", "output_tokens", "cached_tokens", "cache_write_tokens", "reasoning_tokens")

INFLIGHT, DONE, FAILED, INTERRUPTED = "inflight", "done", "failed", "interrupted"


class BudgetRefused(Exception):
    """A reservation would overrun the budget of `scope` `ident`; nothing was written."""

    def __init__(self, scope: str, ident: str) -> None:
        super().__init__(f"{scope} {ident}")
        self.scope, self.ident = scope, ident


class CallInFlight(Exception):
    """The call is in flight already (owned by `owner`): it is not claimed twice; nothing was written."""

    def __init__(self, call_key: str, owner: str | None) -> None:
        super().__init__(f"call {call_key} is in flight (owner {owner})")
        self.call_key, self.owner = call_key, owner


# -- records ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    run_id: str
    session_id: str
    sandbox_id: str
    api_key_id: str | None
    checkpoint_id: str | None
    mode: str
    parent_session_id: str | None
    ended: bool = False
    aligned_at: int | None = None  # for a run from a marked checkpoint: the source run's position of ordinal 0
    source_ip: str | None = None  # the address its sandbox instance was registered with


@dataclass(frozen=True, kw_only=True, slots=True)
class Position:
    run_id: str
    ordinal: int
    call_key: str
    body_hash: str
    source: str  # upstream | store | joined | refused
    delivered: bool
    arrived_at: float | None = None
    delivered_at: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Mark:
    checkpoint_id: str
    session_id: str
    run_id: str
    position: int  # the lowest position the restored agent can re-issue first
    last_position: int | None = None  # the highest (None: exactly `position`); see docs/design/gateway.md


@dataclass(frozen=True, kw_only=True, slots=True)
class Call:
    call_key: str
    session_id: str
    endpoint: str
    provider: str
    model: str
    stream: bool
    body_hash: str
    status: str  # inflight | done | failed | interrupted
    http_status: int | None
    content_type: str | None
    response: bytes | None
    usage: dict[str, int] | None  # token counts by name (TOKEN_FIELDS)
    upstream_request_id: str | None
    owner: str | None
    ok_entry_id: int | None


class _NotOurs(Exception):
    """finish_upstream: the call is not in flight under this owner (the transaction is rolled back)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Attempt:
    """What the ledger needs to know about the caller of one upstream request."""

    call_key: str
    run: Run
    provider: str
    model: str
    endpoint: str
    started_at: float
    reserved: bool = True  # a budget applied when it began: its reservations are settled when it finishes
    owner: str | None = None  # who claims it (None: the ledger's owner); finished under the owner that began it


# The statements of a model call's path, built once: building one costs more than running it on SQLite (about
# 0.2 ms for a select's expression, its cache key and its values; benchmarks/gateway.py, docs/design/database.md).
_BOUND = (sa.select(runs).join(bindings, bindings.c.run_id == runs.c.run_id)
          .where(bindings.c.source_ip == sa.bindparam("ip"), runs.c.ended_at.is_(None)))
_RUN_ENDED = sa.select(runs.c.ended_at).where(runs.c.run_id == sa.bindparam("run_id"))
_RUN_BY_TOKEN = sa.select(runs).where(runs.c.token_hash == sa.bindparam("token_hash"))
_RUN_BY_ID = sa.select(runs).where(runs.c.run_id == sa.bindparam("run_id"))
_CALL = sa.select(calls).where(calls.c.call_key == sa.bindparam("call_key"))
_CALL_FOR_UPDATE = (sa.select(calls.c.status, calls.c.owner).where(calls.c.call_key == sa.bindparam("call_key"))
                    .with_for_update())
_NEW_CALL = calls.insert()
_RETRY_CALL = (calls.update().where(calls.c.call_key == sa.bindparam("key"))
               .values(status=INFLIGHT, owner=sa.bindparam("new_owner"), attempts=calls.c.attempts + 1,
                       http_status=None, response=None, usage=None))
_FINISH_CALL = (calls.update()
                .where(calls.c.call_key == sa.bindparam("key"), calls.c.status == INFLIGHT,
                       calls.c.owner == sa.bindparam("by"))
                .values(status=sa.bindparam("new_status"), http_status=sa.bindparam("new_http_status"),
                        content_type=sa.bindparam("new_content_type"), response=sa.bindparam("new_response"),
                        usage=sa.bindparam("new_usage"), upstream_request_id=sa.bindparam("new_request_id"),
                        finished_at=sa.bindparam("new_finished_at"), owner=None,
                        ok_entry_id=sa.func.coalesce(sa.bindparam("new_ok_entry"), calls.c.ok_entry_id)))
_INTERRUPTIBLE = (sa.select(calls, runs.c.sandbox_id, runs.c.api_key_id)
                  .join(runs, runs.c.run_id == calls.c.run_id).with_for_update(of=calls))
_NEW_POSITION = positions.insert()
_POSITION = sa.select(positions).where(positions.c.run_id == sa.bindparam("run_id"),
                                       positions.c.ordinal == sa.bindparam("ordinal"))
_LATEST_WITH_HASH = (sa.select(positions).where(positions.c.run_id == sa.bindparam("run_id"),
                                                positions.c.body_hash == sa.bindparam("body_hash"))
                     .order_by(positions.c.ordinal.desc()).limit(1))
_NEXT_ORDINAL = sa.select(sa.func.max(positions.c.ordinal)).where(positions.c.run_id == sa.bindparam("run_id"))
_DELIVERED = (positions.update()
              .where(positions.c.run_id == sa.bindparam("run"), positions.c.ordinal == sa.bindparam("at_ordinal"))
              .values(delivered=1, delivered_at=sa.func.coalesce(positions.c.delivered_at, sa.bindparam("when"))))
_NEW_ENTRY = ledger.insert().returning(ledger.c.entry_id)


class Ledger:
    def __init__(self, db: Database, owner: str) -> None:
        self.db = db
        self.owner = owner

    # -- runs and bindings ------------------------------------------------------------------------------------------
    async def create_run(self, run: Run, token_hash: str, source_ip: str | None = None) -> None:
        """Record a run and, with `source_ip`, bind that address to it (replacing any earlier binding)."""
        now = time.time()
        async with self.db.transaction() as conn:
            await conn.execute(runs.insert().values(
                run_id=run.run_id, token_hash=token_hash, session_id=run.session_id, sandbox_id=run.sandbox_id,
                api_key_id=run.api_key_id, checkpoint_id=run.checkpoint_id, mode=run.mode,
                parent_session_id=run.parent_session_id, created_at=now, source_ip=source_ip))
            if source_ip is not None:
                await conn.execute(upsert(self.db.kind, bindings, ["source_ip"],
                                          {"source_ip": source_ip, "run_id": run.run_id, "created_at": now}))

    async def bound_run(self, source_ip: str) -> Run | None:
        """The run whose sandbox instance has this address now, if it is bound and not ended."""
        query = (sa.select(runs).join(bindings, bindings.c.run_id == runs.c.run_id)
                 .where(bindings.c.source_ip == source_ip, runs.c.ended_at.is_(None)))
        async with self.db.read() as conn:
            row = (await conn.execute(query)).first()
        return _run(row) if row else None

    async def caller(self, source_ip: str | None, run_id: str | None) -> tuple[Run | None, bool]:
        """What a request's authentication needs, in one read: the run bound to `source_ip` (as `bound_run`; None
        without an address) and whether the run `run_id` ended (as `run_ended`; True without one)."""
        async with self.db.read() as conn:
            row = (await conn.execute(_BOUND, {"ip": source_ip})).first() if source_ip is not None else None
            ended = True
            if run_id is not None:
                found = (await conn.execute(_RUN_ENDED, {"run_id": run_id})).first()
                ended = found is None or found.ended_at is not None
        return (_run(row) if row else None), ended

    async def bindings(self) -> dict[str, str]:
        """Every bound address and its run."""
        async with self.db.read() as conn:
            rows = await conn.execute(sa.select(bindings.c.source_ip, bindings.c.run_id))
            return {r.source_ip: r.run_id for r in rows}

    async def parent_session(self, session_id: str) -> str | None:
        """The session this one was forked from (recorded by its fork run; later runs of it need not repeat it)."""
        query = (sa.select(runs.c.parent_session_id)
                 .where(runs.c.session_id == session_id, runs.c.parent_session_id.is_not(None))
                 .order_by(runs.c.created_at).limit(1))
        async with self.db.read() as conn:
            found: str | None = (await conn.execute(query)).scalar_one_or_none()
        return found

    async def set_aligned(self, run_id: str, position: int) -> None:
        """Record the run's alignment, once (a later one is ignored)."""
        async with self.db.transaction() as conn:
            await conn.execute(runs.update().where(runs.c.run_id == run_id, runs.c.aligned_at.is_(None))
                               .values(aligned_at=position))

    async def run_by_token_hash(self, token_hash: str) -> Run | None:
        return await self._one_run(_RUN_BY_TOKEN, {"token_hash": token_hash})

    async def run(self, run_id: str) -> Run | None:
        return await self._one_run(_RUN_BY_ID, {"run_id": run_id})

    async def active_run(self, session_id: str) -> Run | None:
        """The session's latest run that has not ended."""
        async with self.db.read() as conn:
            row = (await conn.execute(
                sa.select(runs).where(runs.c.session_id == session_id, runs.c.ended_at.is_(None))
                .order_by(runs.c.created_at.desc()).limit(1))).first()
        return _run(row) if row else None

    async def run_ended(self, run_id: str) -> bool:
        """Whether the run ended (an unknown run counts as ended)."""
        async with self.db.read() as conn:
            row = (await conn.execute(_RUN_ENDED, {"run_id": run_id})).first()
        return row is None or row.ended_at is not None

    async def end_run(self, run_id: str) -> None:
        """End the run (once: its first end time is kept) and unbind its address."""
        async with self.db.transaction() as conn:
            await conn.execute(runs.update().where(runs.c.run_id == run_id, runs.c.ended_at.is_(None))
                               .values(ended_at=time.time()))
            await conn.execute(bindings.delete().where(bindings.c.run_id == run_id))

    async def _one_run(self, query: sa.Select[Any], params: dict[str, Any]) -> Run | None:
        async with self.db.read() as conn:
            row = (await conn.execute(query, params)).first()
        return _run(row) if row else None

    # -- checkpoint marks -------------------------------------------------------------------------------------------
    async def put_mark(self, mark: Mark) -> None:
        """Record the mark of a checkpoint, replacing any earlier one of it."""
        values = {"checkpoint_id": mark.checkpoint_id, "session_id": mark.session_id, "run_id": mark.run_id,
                  "position": mark.position, "created_at": time.time(), "last_position": mark.last_position}
        async with self.db.transaction() as conn:
            await conn.execute(upsert(self.db.kind, marks, ["checkpoint_id"], values))

    async def mark(self, checkpoint_id: str) -> Mark | None:
        async with self.db.read() as conn:
            row = (await conn.execute(sa.select(marks).where(marks.c.checkpoint_id == checkpoint_id))).first()
        return _mark(row) if row else None

    async def marks_of_run(self, run_id: str) -> builtins.list[Mark]:
        async with self.db.read() as conn:
            rows = await conn.execute(sa.select(marks).where(marks.c.run_id == run_id)
                                      .order_by(marks.c.created_at, marks.c.checkpoint_id))
            return [_mark(r) for r in rows]

    # -- positions and divergences ----------------------------------------------------------------------------------
    async def next_ordinal(self, run_id: str) -> int:
        async with self.db.read() as conn:
            top = (await conn.execute(_NEXT_ORDINAL, {"run_id": run_id})).scalar_one_or_none()
        return 0 if top is None else int(top) + 1

    async def positions(self, run_id: str) -> builtins.list[Position]:
        async with self.db.read() as conn:
            rows = await conn.execute(sa.select(positions).where(positions.c.run_id == run_id)
                                      .order_by(positions.c.ordinal))
            return [_position(r) for r in rows]

    async def position(self, run_id: str, ordinal: int) -> Position | None:
        async with self.db.read() as conn:
            row = (await conn.execute(_POSITION, {"run_id": run_id, "ordinal": ordinal})).first()
        return _position(row) if row else None

    async def latest_position_with_hash(self, run_id: str, body_hash: str) -> Position | None:
        async with self.db.read() as conn:
            row = (await conn.execute(_LATEST_WITH_HASH, {"run_id": run_id, "body_hash": body_hash})).first()
        return _position(row) if row else None

    async def add_position(self, p: Position) -> None:
        """Record a position (IntegrityError if the run has it already). Its arrival time defaults to now, and a
        delivered position's delivery time to its arrival."""
        async with self.db.transaction() as conn:
            await conn.execute(_NEW_POSITION, _position_values(p))

    async def set_delivered(self, run_id: str, ordinal: int, at: float | None = None) -> None:
        """The position's answer reached the client at `at` (default: now); its first delivery time is kept."""
        when = time.time() if at is None else at
        async with self.db.transaction() as conn:
            await conn.execute(_DELIVERED, {"run": run_id, "at_ordinal": ordinal, "when": when})

    async def record_divergence(self, run_id: str, ordinal: int, expected: Position, got_hash: str) -> None:
        async with self.db.transaction() as conn:
            await conn.execute(divergences.insert().values(
                run_id=run_id, ordinal=ordinal, expected_call_key=expected.call_key,
                expected_hash=expected.body_hash, got_hash=got_hash, created_at=time.time()))

    async def divergences(self, run_id: str | None = None) -> builtins.list[dict[str, Any]]:
        query = sa.select(divergences)
        if run_id is not None:
            query = query.where(divergences.c.run_id == run_id)
        async with self.db.read() as conn:
            return [dict(r._mapping) for r in await conn.execute(query.order_by(divergences.c.id))]

    # -- calls ------------------------------------------------------------------------------------------------------
    async def call(self, call_key: str) -> Call | None:
        async with self.db.read() as conn:
            row = (await conn.execute(_CALL, {"call_key": call_key})).first()
        return _call(row) if row else None

    async def calls(self) -> builtins.list[Call]:
        async with self.db.read() as conn:
            rows = await conn.execute(sa.select(calls).order_by(calls.c.created_at, calls.c.call_key))
            return [_call(r) for r in rows]

    async def any_inflight(self) -> bool:
        async with self.db.read() as conn:
            row = (await conn.execute(sa.select(calls.c.call_key).where(calls.c.status == INFLIGHT).limit(1))).first()
        return row is not None

    async def begin_upstream(self, a: Attempt, stream: bool, body_hash: str, position: Position | None,
                             scopes: builtins.list[tuple[str, str]], amount_nano: int,
                             alive: Callable[[str], bool] | None = None) -> str | None:
        """Claim a call for one upstream request, in one transaction: reserve `amount_nano` on each budget of
        `scopes` that exists, record `position` (if any) and mark the call `inflight`, owned by the attempt's owner.

        A call in flight already is taken over only if `alive` is given and its owner is gone (a node's incarnation
        by the `nodes` table, any other owner by `alive`): its attempt is interrupted first, in this transaction, as
        `recover` would (ledger_claims.py). The owner taken over from, else None.

        BudgetRefused if a budget could be overrun, CallInFlight if the call is in flight under an owner that is not
        gone; nothing is written then."""
        owner, taken = a.owner or self.owner, None
        try:
            async with self.db.transaction() as conn:
                existing = (await conn.execute(_CALL_FOR_UPDATE, {"call_key": a.call_key})).first()
                if existing is not None and existing.status == INFLIGHT:
                    if alive is None or existing.owner is None or existing.owner == owner \
                            or not await owner_gone(conn, existing.owner, alive):
                        raise CallInFlight(a.call_key, existing.owner)
                    row = (await conn.execute(_INTERRUPTIBLE.where(calls.c.call_key == a.call_key))).one()
                    await _interrupt(conn, row)
                    taken = existing.owner
                for scope, ident in scopes:
                    if not await reserve(conn, a.call_key, owner, scope, ident, amount_nano):
                        raise BudgetRefused(scope, ident)
                if position is not None:
                    await conn.execute(_NEW_POSITION, _position_values(position))
                if existing is None:
                    await conn.execute(_NEW_CALL, {
                        "call_key": a.call_key, "session_id": a.run.session_id, "run_id": a.run.run_id,
                        "endpoint": a.endpoint, "provider": a.provider, "model": a.model, "stream": int(stream),
                        "body_hash": body_hash, "status": INFLIGHT, "owner": owner, "attempts": 1,
                        "created_at": a.started_at})
                else:
                    await conn.execute(_RETRY_CALL, {"key": a.call_key, "new_owner": owner})
        except BudgetRefused:
            if taken is not None:  # refused, but the gone owner's attempt is lost all the same: settle it
                await self._interrupt_lost(a.call_key, taken)
            raise
        except sa.exc.IntegrityError as e:
            # Another transaction inserted the call meanwhile (PostgreSQL; SQLite's write lock rules it out).
            if not duplicate(e) or (position is not None and await self._position_taken(position)):
                raise
            raise CallInFlight(a.call_key, None) from None
        return taken

    async def _interrupt_lost(self, call_key: str, owner: str) -> None:
        """Interrupt the call if it is still in flight under `owner` (judged gone already: it stays gone)."""
        async with self.db.transaction() as conn:
            query = _INTERRUPTIBLE.where(calls.c.call_key == call_key, calls.c.status == INFLIGHT,
                                         calls.c.owner == owner)
            if (row := (await conn.execute(query)).first()) is not None:
                await _interrupt(conn, row)

    async def owner_gone(self, owner: str, alive: Callable[[str], bool]) -> bool:
        """Whether the owner of a call in flight is gone (as `begin_upstream` judges it), in one read."""
        async with self.db.read() as conn:
            return await owner_gone(conn, owner, alive)

    async def _position_taken(self, p: Position) -> bool:
        return await self.position(p.run_id, p.ordinal) is not None

    async def finish_upstream(self, a: Attempt, *, ok: bool, outcome: str, http_status: int | None,
                              content_type: str | None, response: bytes, usage: Mapping[str, int] | None,
                              request_id: str | None, cost_nano: int, priced: bool) -> int | None:
        """Store the response, write the call's ledger entry and turn its reservations into spending, in one
        transaction; the entry's ID. Only a call in flight and owned by the attempt's owner is finished: for any
        other (finished already, or recovered as interrupted, or taken over) nothing is written and the answer is
        None."""
        now = time.time()
        try:
            async with self.db.transaction() as conn:
                # The entry first, so that the call's one update can name it; rolled back if the call is not ours.
                entry_id = await _insert_entry(conn, "upstream", outcome, a, http_status, usage or {}, cost_nano,
                                               priced, request_id, None, now)
                claimed = await conn.execute(_FINISH_CALL, {
                    "key": a.call_key, "by": a.owner or self.owner, "new_status": DONE if ok else FAILED,
                    "new_http_status": http_status, "new_content_type": content_type, "new_response": response,
                    "new_usage": json.dumps(dict(usage)) if usage is not None else None,
                    "new_request_id": request_id, "new_finished_at": now, "new_ok_entry": entry_id if ok else None})
                if claimed.rowcount != 1:
                    raise _NotOurs
                if a.reserved:
                    await settle(conn, a.call_key, a.owner or self.owner, cost_nano)
        except _NotOurs:
            return None
        return entry_id

    async def record_served(self, kind: str, a: Attempt, original_entry_id: int | None,
                            http_status: int | None) -> int:
        """A zero-cost ledger entry for an answer given without going upstream (`store` or `joined`)."""
        async with self.db.transaction() as conn:
            return await _insert_entry(conn, kind, "ok", a, http_status, {}, 0, True, None, original_entry_id,
                                       time.time())

    async def recover(self, alive: Callable[[str], bool]) -> builtins.list[str]:
        """Mark the in-flight calls whose owner is gone (a node's incarnation by the `nodes` table, any other owner
        by `alive`) `interrupted`, each with a ledger entry, and charge their whole reservations (the provider may
        have billed them), in one transaction; their call keys."""
        found: builtins.list[str] = []
        query = (_INTERRUPTIBLE.where(calls.c.status == INFLIGHT, calls.c.owner.is_not(None))
                 .order_by(calls.c.created_at, calls.c.call_key))
        async with self.db.transaction() as conn:
            gone = await gone_judge(conn, alive)
            for row in (await conn.execute(query)).all():
                if gone(row.owner):
                    await _interrupt(conn, row)
                    found.append(row.call_key)
        return found

    # -- budgets and the ledger -------------------------------------------------------------------------------------
    async def set_budget(self, scope: str, ident: str, limit_nano: int) -> None:
        """Create the budget, or change its limit (what it spent and reserved is kept)."""
        async with self.db.transaction() as conn:
            await conn.execute(upsert(self.db.kind, budgets, ["scope", "ident"],
                                      {"scope": scope, "ident": ident, "limit_nano": limit_nano}))

    async def budget(self, scope: str, ident: str) -> dict[str, Any] | None:
        """The budget's row (scope, ident, limit_nano, spent_nano, reserved_nano), or None."""
        async with self.db.read() as conn:
            row = (await conn.execute(sa.select(budgets).where(budgets.c.scope == scope,
                                                               budgets.c.ident == ident))).first()
        return dict(row._mapping) if row else None

    async def existing_budgets(self, scopes: Sequence[tuple[str, str]]) -> builtins.list[tuple[str, str]]:
        """The scopes of `scopes` that have a budget, in their order, in one read."""
        async with self.db.read() as conn:
            return await existing_budgets(conn, scopes)

    async def call_and_budgets(self, call_key: str,
                               scopes: Sequence[tuple[str, str]]) -> tuple[Call | None, builtins.list[tuple[str, str]]]:
        """`call(call_key)` and `existing_budgets(scopes)` in one read: what a model call looks up before it goes
        upstream."""
        async with self.db.read() as conn:
            row = (await conn.execute(_CALL, {"call_key": call_key})).first()
            return (_call(row) if row else None), await existing_budgets(conn, scopes)

    async def budgets(self) -> builtins.list[dict[str, Any]]:
        async with self.db.read() as conn:
            rows = await conn.execute(sa.select(budgets).order_by(budgets.c.scope, budgets.c.ident))
            return [dict(r._mapping) for r in rows]

    async def entries(self, session_id: str | None = None) -> builtins.list[dict[str, Any]]:
        """The ledger's entries (of one session), oldest first, as rows (column name -> value)."""
        query = sa.select(ledger)
        if session_id is not None:
            query = query.where(ledger.c.session_id == session_id)
        async with self.db.read() as conn:
            return [dict(r._mapping) for r in await conn.execute(query.order_by(ledger.c.entry_id))]


# -- statements shared by several methods ---------------------------------------------------------------------------
def _position_values(p: Position) -> dict[str, Any]:
    arrived = time.time() if p.arrived_at is None else p.arrived_at
    delivered_at = (arrived if p.delivered_at is None else p.delivered_at) if p.delivered else None
    return {"run_id": p.run_id, "ordinal": p.ordinal, "call_key": p.call_key, "body_hash": p.body_hash,
            "source": p.source, "delivered": int(p.delivered), "arrived_at": arrived, "delivered_at": delivered_at}


async def _insert_entry(conn: Conn, kind: str, outcome: str, a: Attempt, http_status: int | None,
                        usage: Mapping[str, int], cost_nano: int, priced: bool, request_id: str | None,
                        original: int | None, now: float) -> int:
    done = await conn.execute(_NEW_ENTRY, {
        "kind": kind, "outcome": outcome, "call_key": a.call_key, "session_id": a.run.session_id,
        "sandbox_id": a.run.sandbox_id, "api_key_id": a.run.api_key_id, "run_id": a.run.run_id, "provider": a.provider,
        "model": a.model, "endpoint": a.endpoint, "http_status": http_status,
        **{f: int(usage.get(f) or 0) for f in TOKEN_FIELDS}, "cost_nano": cost_nano, "priced": int(priced),
        "upstream_request_id": request_id, "original_entry_id": original, "started_at": a.started_at,
        "finished_at": now})
    return int(done.scalar_one())


async def _interrupt(conn: Conn, row: Row[Any]) -> None:
    """The upstream request of a call in flight (a row of _INTERRUPTIBLE, locked) is lost with its owner: the call
    is `interrupted`, with an `upstream` entry of outcome `interrupted` (tokens unknown, cost 0), and its owner's
    whole reservation is charged (the provider may have billed it)."""
    run = Run(run_id=row.run_id, session_id=row.session_id, sandbox_id=row.sandbox_id, api_key_id=row.api_key_id,
              checkpoint_id=None, mode="", parent_session_id=None)
    a = Attempt(call_key=row.call_key, run=run, provider=row.provider, model=row.model, endpoint=row.endpoint,
                started_at=row.created_at)
    await conn.execute(calls.update().where(calls.c.call_key == row.call_key).values(status=INTERRUPTED, owner=None))
    await _insert_entry(conn, "upstream", INTERRUPTED, a, None, {}, 0, True, None, None, time.time())
    await settle(conn, row.call_key, row.owner, None)


# -- rows to records ------------------------------------------------------------------------------------------------
def _run(row: Row[Any]) -> Run:
    return Run(run_id=row.run_id, session_id=row.session_id, sandbox_id=row.sandbox_id, api_key_id=row.api_key_id,
               checkpoint_id=row.checkpoint_id, mode=row.mode, parent_session_id=row.parent_session_id,
               ended=row.ended_at is not None, aligned_at=row.aligned_at, source_ip=row.source_ip)


def _position(row: Row[Any]) -> Position:
    return Position(run_id=row.run_id, ordinal=row.ordinal, call_key=row.call_key, body_hash=row.body_hash,
                    source=row.source, delivered=bool(row.delivered), arrived_at=row.arrived_at,
                    delivered_at=row.delivered_at)


def _mark(row: Row[Any]) -> Mark:
    return Mark(checkpoint_id=row.checkpoint_id, session_id=row.session_id, run_id=row.run_id,
                position=row.position, last_position=row.last_position)


def _call(row: Row[Any]) -> Call:
    return Call(call_key=row.call_key, session_id=row.session_id, endpoint=row.endpoint, provider=row.provider,
                model=row.model, stream=bool(row.stream), body_hash=row.body_hash, status=row.status,
                http_status=row.http_status, content_type=row.content_type,
                response=bytes(row.response) if row.response is not None else None,
                usage=json.loads(row.usage) if row.usage else None, upstream_request_id=row.upstream_request_id,
                owner=row.owner, ok_entry_id=row.ok_entry_id)
