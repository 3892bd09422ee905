"""The Gateway: runs and their tokens, call-key resolution, budgets, and the decision upstream / store / join.

The HTTP layer (keepstate.gateway.http) parses requests into `CallRequest`s and renders `Answer`s; this module
decides. Rules: docs/design/gateway.md.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import ipaddress
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import aiohttp

from keepstate import netaddr
from keepstate.db.engine import Database
from keepstate.db.errors import DatabaseUnavailable
from keepstate.db.repos.ledger import Attempt, BudgetRefused, CallInFlight, Ledger, Mark, Position, Run
from keepstate.gateway import budget, callkey, errors, marks, providers
from keepstate.gateway.calls import InflightCall, UpstreamCall, now, stored_chunks
from keepstate.gateway.config import GatewayConfig, ProviderConfig, ProviderKind
from keepstate.gateway.errors import GatewayError
from keepstate.gateway.owners import Owners
from keepstate.gateway.prices import NANO_PER_USD, PriceTable

log = logging.getLogger("keepstate.gateway")

Mode = Literal["diverge", "replay"]
BudgetScope = Literal["key", "session"]
TOKEN_PREFIX = "ksgw-"


@dataclass(frozen=True)
class CallRequest:
    """One parsed model call, as the HTTP layer hands it over."""

    token: str | None
    endpoint: str  # chat | responses | embeddings | messages
    body: dict[str, Any]
    raw: bytes
    headers: dict[str, str]  # lower-cased names
    peer: str | None = None  # the caller's address (a sandbox instance's own, or the host's loopback)

    @property
    def stream(self) -> bool:
        return self.endpoint != "embeddings" and self.body.get("stream") is True


@dataclass
class Answer:
    """What to send back: either a live call to follow, or stored bytes."""

    call_key: str
    source: str  # upstream | store | joined
    live: InflightCall | None = None
    status: int = 200
    content_type: str = "application/json"
    chunks: list[bytes] | None = None
    request_id: str | None = None
    run_id: str = ""
    ordinal: int | None = None  # the position this call took (None for a retry)
    delivers: int | None = None  # the position whose answer this is (the retried one for a retry)


@dataclass
class _RunState:
    run: Run
    next_ordinal: int
    aligned: int | None = None  # the source run's position of ordinal 0, once found (see marks.align)


class BindingPending(GatewayError):
    """A request from a sandbox address that no run is bound to yet, carrying a token of a bound run: the
    instance was just restored and the server has not registered it yet. The HTTP layer waits and asks again."""

    def __init__(self, peer: str) -> None:
        e = errors.not_bound_yet(peer)
        super().__init__(e.status, e.kind, e.message, e.param, e.headers)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@functools.lru_cache(maxsize=4096)
def normal_ip(address: str) -> str:
    """One spelling per address (an IPv4 peer can reach a dual-stack socket as ::ffff:a.b.c.d); remembered, as
    every call of a sandbox comes from the same few."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


# The host's own callers; never a sandbox instance (those have addresses of their own, 10.88.x.y). A host process
# that reaches the gateway at the sandboxes' address for it (a sandbox's OPENAI_BASE_URL) comes from that address.
HOST_PEERS = frozenset({"127.0.0.1", "::1", netaddr.GATEWAY_IP})


class Gateway:
    """One per process, on the process's Database (which it does not close). Other processes (a standalone
    `keepstate gateway`, `keepstate ledger`) may share the database: see the design doc."""

    def __init__(self, config: GatewayConfig, db: Database) -> None:
        self.config = config
        self.owners = Owners()  # what this gateway writes on the calls it has in flight (owners.py)
        self.ledger = Ledger(db, self.owners.process)
        self.prices = PriceTable.load(config.price_table)
        # Decisions (begin) are taken one at a time, so that ordinals follow arrival order and a call in flight is
        # seen by the next request for it: the lock covers the database awaits between the checks and the claim.
        self._deciding = asyncio.Lock()
        self._states: dict[str, _RunState] = {}  # run id -> ordinals; the database is the authority
        self._tokens: dict[str, Run] = {}  # token hash -> the run it was issued to (ended or not)
        self._lineages: dict[str, tuple[str, ...]] = {}  # session -> itself and its ancestors, nearest first
        self._inflight: dict[str, InflightCall] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._delivering: set[asyncio.Task[None]] = set()  # delivery times being written (delivered)
        self._session: aiohttp.ClientSession | None = None

    # --- lifecycle -----------------------------------------------------------------------------------------------

    def attach_node(self, node_id: str, incarnation: Callable[[], int]) -> None:
        """This gateway is the one of node `node_id` of a `keepstate serve` (before `start`): the calls it claims
        are its node's current incarnation's, judged alive or gone by the shared `nodes` table on every node, so
        that a call whose node died is taken over by one other node, once (docs/design/cluster.md)."""
        self.owners.attach(node_id, incarnation)

    @property
    def owner(self) -> str:
        """What the calls this gateway claims now carry."""
        return self.owners.current()

    async def start(self) -> None:
        """Set the configured budgets, recover the calls of dead gateways, and open the upstream client."""
        for ident, usd in self.config.key_budgets_usd.items():
            await self.set_budget("key", ident, usd)
        for ident, usd in self.config.session_budgets_usd.items():
            await self.set_budget("session", ident, usd)
        interrupted = await self._recover()
        if interrupted:
            log.warning("%d calls were interrupted by a gateway that died: %s", len(interrupted), interrupted)
        connector = aiohttp.TCPConnector(limit=0, enable_cleanup_closed=False)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=True)

    async def close(self, grace_s: float = 30.0) -> None:
        """Let upstream calls in flight finish (up to `grace_s`), then close."""
        await self._delivered_written()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks))
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def drain(self) -> None:
        """Wait until no upstream call is in flight (tests and benchmarks)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))
        await self._delivered_written()

    # --- runs, checkpoints, budgets (the integration API) --------------------------------------------------------

    async def register_run(
        self, session_id: str, sandbox_id: str, api_key_id: str | None, checkpoint_id: str | None,
        mode: Mode = "diverge", parent_session_id: str | None = None, source_ip: str | None = None,
    ) -> str:
        """Start a run of a session and return its bearer token (the sandbox's OPENAI_API_KEY/ANTHROPIC_API_KEY).

        With `source_ip`, requests from that address belong to this run whatever token of the session's fork
        chain they carry (processes keep the token of the run they were started in), and any earlier binding of
        the address ends."""
        if mode not in ("diverge", "replay"):
            raise ValueError(f"mode must be 'diverge' or 'replay', not {mode!r}")
        if mode == "replay" and (parent_session_id is None or checkpoint_id is None):
            raise ValueError("replay mode needs the parent session and the checkpoint the fork starts from")
        ip = None if source_ip is None else normal_ip(source_ip)
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        run = Run(run_id="run_" + secrets.token_hex(8), session_id=session_id, sandbox_id=sandbox_id,
                  api_key_id=api_key_id, checkpoint_id=checkpoint_id, mode=mode, parent_session_id=parent_session_id,
                  source_ip=ip)
        await self.ledger.create_run(run, token_hash(token), ip)
        self._tokens[token_hash(token)] = run
        self._states[run.run_id] = _RunState(run, 0)
        return token

    async def end_run(self, token: str) -> None:
        """The run's sandbox instance is gone: its token is refused from now on and its address unbound."""
        run = await self._token_run(token)
        if run is not None:
            await self.ledger.end_run(run.run_id)
            self._states.pop(run.run_id, None)

    async def run_of(self, token: str) -> Run | None:
        """The run a token was issued to, while it has not ended."""
        run = await self._token_run(token)
        return None if run is None or await self.ledger.run_ended(run.run_id) else run

    def sandbox_env(self, token: str, base_url: str) -> dict[str, str]:
        """Environment that points the official SDKs in a sandbox at this gateway."""
        base = base_url.rstrip("/")
        return {
            "OPENAI_BASE_URL": base + "/v1",
            "OPENAI_API_KEY": token,
            "ANTHROPIC_BASE_URL": base,
            "ANTHROPIC_API_KEY": token,
        }

    async def mark_checkpoint(self, session_id: str, checkpoint_id: str, frozen_from: float | None = None,
                        frozen_until: float | None = None) -> int:
        """Record where the session's current run stood when checkpoint `checkpoint_id` froze its sandbox.

        Call it once the checkpoint is published, whatever the sandbox did since. `frozen_from`/`frozen_until`
        (`time.time()` just before and just after the sandbox was frozen for the image) bound the freeze; without
        them the mark is a wider window that the restored run's first call narrows by its body. Returns the
        lowest position the restored agent can make first."""
        await self._delivered_written()  # every answer sent so far counts as delivered in the mark
        run = await self.ledger.active_run(session_id)
        if run is None:
            raise LookupError(f"session {session_id} has no active gateway run")
        positions = await self.ledger.positions(run.run_id)
        floor = max((m.position for m in await self.ledger.marks_of_run(run.run_id)), default=0)
        until = time.time() if frozen_until is None else frozen_until
        first, last = marks.window(positions, frozen_from, until, floor)
        await self.ledger.put_mark(Mark(checkpoint_id=checkpoint_id, session_id=session_id, run_id=run.run_id,
                                        position=first, last_position=last))
        return first

    async def set_budget(self, scope: BudgetScope, ident: str, limit_usd: float) -> None:
        if scope not in ("key", "session"):
            raise ValueError(f"budget scope must be 'key' or 'session', not {scope!r}")
        await self.ledger.set_budget(scope, ident, round(limit_usd * NANO_PER_USD))

    async def budget(self, scope: BudgetScope, ident: str) -> dict[str, float] | None:
        b = await self.ledger.budget(scope, ident)
        return None if b is None else {k: b[f"{k}_nano"] / NANO_PER_USD for k in ("limit", "spent", "reserved")}

    async def _token_run(self, token: str) -> Run | None:
        h = token_hash(token)
        run = self._tokens.get(h)
        if run is None:
            run = await self.ledger.run_by_token_hash(h)
            if run is not None:
                self._tokens[h] = run
        return run

    async def _state(self, run: Run) -> _RunState:
        state = self._states.get(run.run_id)
        if state is None:
            next_ordinal = await self.ledger.next_ordinal(run.run_id)
            # setdefault: a state made by another request while this one read the database is the one to keep
            state = self._states.setdefault(run.run_id, _RunState(run, next_ordinal, run.aligned_at))
        return state

    async def lineage(self, session_id: str) -> tuple[str, ...]:
        """The session and the sessions it was forked from, nearest first."""
        chain = self._lineages.get(session_id)
        if chain is None:
            found = [session_id]
            while (parent := await self.ledger.parent_session(found[-1])) is not None and parent not in found:
                found.append(parent)
            chain = self._lineages[session_id] = tuple(found)
        return chain

    async def _caller(self, token: str | None, peer: str | None) -> _RunState:
        """The run a request belongs to: the one bound to its address, else the one its token was issued to."""
        token_run = await self._token_run(token) if token else None
        peer = normal_ip(peer) if peer is not None else None
        bound, ended = await self.ledger.caller(peer, token_run.run_id if token_run is not None else None)
        if peer is not None:
            if bound is not None:
                # The token only proves the caller is of this session's family; the address says which run.
                if token_run is None or token_run.session_id not in await self.lineage(bound.session_id):
                    raise errors.unauthenticated()
                return await self._state(bound)
            if (token_run is not None and token_run.source_ip is not None and token_run.source_ip != peer
                    and peer not in HOST_PEERS):
                raise BindingPending(peer)
        if token_run is None or ended:
            raise errors.unauthenticated()
        return await self._state(token_run)

    # --- calls ---------------------------------------------------------------------------------------------------

    async def authenticate(self, token: str | None, peer: str | None = None) -> Run:
        """The caller's run; raises GatewayError (401, or BindingPending) otherwise."""
        return (await self._caller(token, peer)).run

    async def authenticate_waiting(self, token: str | None, peer: str | None = None) -> Run:
        """`authenticate`, waiting up to `binding_wait_s` for a just-restored sandbox instance to be bound."""
        return (await self.caller_waiting(token, peer)).run

    async def caller_waiting(self, token: str | None, peer: str | None = None) -> _RunState:
        """The caller's run state, as `authenticate_waiting` finds it: what `begin` takes, so that a call is
        authenticated once."""
        deadline = time.monotonic() + self.config.binding_wait_s
        while True:
            try:
                return await self._caller(token, peer)
            except BindingPending:
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.05)

    def route(self, endpoint: str, model: Any) -> ProviderConfig:
        if not isinstance(model, str) or not model:
            raise errors.invalid("you must provide a model parameter", "model")
        kind: ProviderKind = "anthropic" if endpoint == "messages" else "openai"
        provider = self.config.provider_for(kind, model)
        if provider is None:
            raise errors.unknown_model(model)
        return provider

    def listed_models(self, kind: str) -> list[str]:
        return [m for p in self.config.providers if p.kind == kind for m in p.listed_models()]

    async def begin(self, req: CallRequest, caller: _RunState | None = None) -> Answer:
        """Decide how to answer one call; everything up to the upstream request happens here, one call at a time,
        so that ordinals follow arrival order. `caller`: the run state `caller_waiting` found for this request (else
        it is found here)."""
        async with self._deciding:
            return await self._begin(req, caller or await self._caller(req.token, req.peer))

    async def _begin(self, req: CallRequest, state: _RunState) -> Answer:
        run = state.run
        provider = self.route(req.endpoint, req.body.get("model"))
        digest = callkey.body_hash(req.endpoint, req.body)
        key, ordinal, delivers = await self._resolve(state, req, digest)
        attempt = Attempt(call_key=key, run=run, provider=provider.name, model=str(req.body["model"]),
                          endpoint=req.endpoint, started_at=now())

        live = self._inflight.get(key)
        if live is not None:
            await self._add_position(run, ordinal, key, digest, "joined")
            live.joiners.append(attempt)
            return Answer(key, "joined", live=live, run_id=run.run_id, ordinal=ordinal, delivers=delivers)

        stored, applicable = await self.ledger.call_and_budgets(key, _scopes(run))
        if stored is not None and stored.status == "done" and stored.response is not None:
            await self._add_position(run, ordinal, key, digest, "store")
            await self.ledger.record_served("store", attempt, stored.ok_entry_id, stored.http_status)
            hide = providers.hides_usage(req.endpoint, req.body, stored.stream)
            return Answer(
                key, "store", status=stored.http_status or 200, content_type=stored.content_type or "application/json",
                chunks=stored_chunks(stored.endpoint, stored.stream, stored.response, hide),
                request_id=stored.upstream_request_id, run_id=run.run_id, ordinal=ordinal, delivers=delivers,
            )
        if stored is not None and stored.status == "inflight" and stored.owner is not None \
                and not await self.ledger.owner_gone(stored.owner, self.owners.alive):
            # In flight under a live owner: another process, or another node (it stores the answer; the retry
            # that comes after finds it). Its owner gone, the claim below takes the call over, once.
            raise errors.in_progress_elsewhere()
        return await self._go_upstream(req, attempt, provider, digest, ordinal, delivers, applicable)

    async def _recover(self) -> list[str]:
        """Recover the calls in flight whose owner is gone (as interrupted, billed once)."""
        return await self.ledger.recover(self.owners.alive)

    async def _resolve(self, state: _RunState, req: CallRequest, digest: str) -> tuple[str, int | None, int | None]:
        """The call key, the new ordinal (None for a retry, which takes none), and the position answered."""
        run = state.run
        retrying = callkey.retry_count(req.headers.get("x-stainless-retry-count")) > 0
        idem = req.headers.get("idempotency-key")
        previous = await self.ledger.latest_position_with_hash(run.run_id, digest) if retrying else None
        if idem and not idem.startswith("stainless-"):  # SDK-made keys are random per request: not an identity
            key = callkey.idempotency_call_key(run.session_id, idem)
            if previous is not None:
                return key, None, previous.ordinal
            ordinal = self._take_ordinal(state)
            return key, ordinal, ordinal
        if previous is not None:
            return previous.call_key, None, previous.ordinal
        ordinal = self._take_ordinal(state)
        key = callkey.position_call_key(run.session_id, run.checkpoint_id, ordinal, digest)
        if key in self._inflight or run.checkpoint_id is None or await self.ledger.call(key) is not None:
            return key, ordinal, ordinal
        mark = await self.ledger.mark(run.checkpoint_id)
        if mark is None or mark.run_id == run.run_id:
            return key, ordinal, ordinal
        if not (mark.session_id == run.session_id
                or (run.mode == "replay" and mark.session_id == run.parent_session_id)):
            return key, ordinal, ordinal
        source = await self._source_position(state, mark, ordinal, digest)
        if source is None:
            return key, ordinal, ordinal
        if source.body_hash == digest:
            return source.call_key, ordinal, ordinal
        await self.ledger.record_divergence(run.run_id, ordinal, source, digest)
        return key, ordinal, ordinal

    async def _source_position(self, state: _RunState, mark: Mark, ordinal: int, digest: str) -> Position | None:
        """The call of the marked run that this run's call `ordinal` makes again (if the bodies agree)."""
        if state.aligned is None:
            last = mark.position if mark.last_position is None else mark.last_position
            if ordinal >= marks.ALIGN_ATTEMPTS or last == mark.position:
                await self._align(state, mark.position)  # nothing to choose from, or nothing re-issued: settle
            else:
                source = {p.ordinal: p for p in await self.ledger.positions(mark.run_id)}
                found = marks.align(source, ordinal, digest, mark.position, last)
                if found is None:
                    return source.get(mark.position + ordinal)  # compared with the earliest candidate
                await self._align(state, found)
                return source[found + ordinal]
        assert state.aligned is not None
        return await self.ledger.position(mark.run_id, state.aligned + ordinal)

    async def _align(self, state: _RunState, offset: int) -> None:
        state.aligned = offset
        await self.ledger.set_aligned(state.run.run_id, offset)

    def _take_ordinal(self, state: _RunState) -> int:
        ordinal = state.next_ordinal
        state.next_ordinal += 1
        return ordinal

    async def _add_position(self, run: Run, ordinal: int | None, key: str, digest: str, source: str) -> None:
        if ordinal is not None:
            # A refused call is answered at once, and finally (429 without retry): the agent moves on.
            await self.ledger.add_position(Position(run_id=run.run_id, ordinal=ordinal, call_key=key, body_hash=digest,
                                                    source=source, delivered=source == "refused"))

    async def _go_upstream(
        self, req: CallRequest, attempt: Attempt, provider: ProviderConfig, digest: str, ordinal: int | None,
        delivers: int | None, applicable: list[tuple[str, str]],
    ) -> Answer:
        """`applicable`: the budgets of the call's scopes that exist (read with the call's stored answer)."""
        run = attempt.run
        # Claimed by the owner this gateway is now, and finished by the same (a rejoin moves the node's on).
        attempt = replace(attempt, owner=self.owners.current(), reserved=bool(applicable))
        amount, cap_field = 0, None
        if applicable:
            price = self.prices.price(attempt.model)
            if price is None:
                await self._add_position(run, ordinal, attempt.call_key, digest, "refused")
                raise GatewayError(429, "budget", f"Model {attempt.model} has no price, and a budget applies.",
                                   headers={"x-should-retry": "false"})
            worst = budget.worst_case(req.endpoint, req.body, len(req.raw), self.config.default_max_output_tokens)
            amount, cap_field = price.worst_case_nano(worst.input_tokens, worst.output_tokens), worst.cap_field
        position = None if ordinal is None else Position(run_id=run.run_id, ordinal=ordinal, call_key=attempt.call_key,
                                                         body_hash=digest, source="upstream", delivered=False)
        try:
            taken = await self.ledger.begin_upstream(attempt, req.stream, digest, position, applicable, amount,
                                                     alive=self.owners.alive)
        except BudgetRefused as e:
            await self._add_position(run, ordinal, attempt.call_key, digest, "refused")
            raise errors.over_budget(e.scope, e.ident) from None
        except CallInFlight:  # another gateway (process or node) claimed it since it was looked at
            raise errors.in_progress_elsewhere() from None
        if taken is not None:
            log.warning("call %s: its owner %s is gone; interrupted and taken over by %s", attempt.call_key, taken,
                        attempt.owner)
        upstream = providers.build(provider, req.endpoint, req.body, req.raw, req.headers, req.stream, cap_field,
                                   self.config.default_max_output_tokens)
        live = InflightCall(attempt.call_key, req.endpoint, req.stream)
        self._inflight[attempt.call_key] = live
        assert self._session is not None, "Gateway.start() was not called"
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.config.upstream_connect_timeout_s, sock_read=self.config.upstream_timeout_s
        )
        job = UpstreamCall(live, attempt, provider, upstream, self.ledger, self.prices, self._session, timeout,
                           self._finished)
        task = asyncio.get_running_loop().create_task(job.run())
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return Answer(attempt.call_key, "upstream", live=live, run_id=run.run_id, ordinal=ordinal, delivers=delivers)

    def _finished(self, call: InflightCall) -> None:
        self._inflight.pop(call.key, None)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("upstream call failed inside the gateway", exc_info=task.exception())

    def delivered(self, answer: Answer) -> None:
        """The client has the whole answer: a checkpoint taken from now on will not expect this call again. The
        time is taken now and written once the handler has returned (its connection takes the next request
        meanwhile); a mark, a drain and a close wait for the writes begun before them."""
        if answer.delivers is None:
            return
        at = time.time()  # now, not when the write gets the database: the client may act meanwhile
        task = asyncio.get_running_loop().create_task(self._set_delivered(answer.run_id, answer.delivers, at))
        self._delivering.add(task)
        task.add_done_callback(self._delivering.discard)

    async def _set_delivered(self, run_id: str, ordinal: int, at: float) -> None:
        try:
            await self.ledger.set_delivered(run_id, ordinal, at)
        except DatabaseUnavailable as e:  # the answer was sent: the position stays undelivered (conservative)
            log.warning("position %s of run %s not marked delivered: %s", ordinal, run_id, e)

    async def _delivered_written(self) -> None:
        if self._delivering:
            await asyncio.wait(set(self._delivering))


def _scopes(run: Run) -> list[tuple[str, str]]:
    """The budget scopes a run's calls are charged to: its session's, and its API key's if it has one."""
    return [("session", run.session_id)] + ([("key", run.api_key_id)] if run.api_key_id else [])
