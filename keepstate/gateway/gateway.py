"""The Gateway: runs and their tokens, call-key resolution, budgets, and the decision upstream / store / join.

The HTTP layer (keepstate.gateway.http) parses requests into `CallRequest`s and renders `Answer`s; this module
decides. Rules: docs/design/gateway.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from keepstate.gateway import budget, callkey, errors, marks, providers
from keepstate.gateway.calls import InflightCall, UpstreamCall, now, stored_chunks
from keepstate.gateway.config import GatewayConfig, ProviderConfig, ProviderKind
from keepstate.gateway.errors import GatewayError
from keepstate.gateway.prices import NANO_PER_USD, PriceTable
from keepstate.gateway.store import Attempt, BudgetRefused, Mark, Position, Run, Store, owner_alive

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


def normal_ip(address: str) -> str:
    """One spelling per address (an IPv4 peer can reach a dual-stack socket as ::ffff:a.b.c.d)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


# The host's own callers; never a sandbox instance (those have addresses of their own, 10.88.x.y).
HOST_PEERS = frozenset({"127.0.0.1", "::1"})


class Gateway:
    """One per process. Safe to share its SQLite file with other processes (see the design doc)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.store = Store(config.db_path)
        self.prices = PriceTable.load(config.price_table)
        self._states: dict[str, _RunState] = {}  # run id -> ordinals; the database is the authority
        self._tokens: dict[str, Run] = {}  # token hash -> the run it was issued to (ended or not)
        self._lineages: dict[str, tuple[str, ...]] = {}  # session -> itself and its ancestors, nearest first
        self._inflight: dict[str, InflightCall] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        for ident, usd in config.key_budgets_usd.items():
            self.set_budget("key", ident, usd)
        for ident, usd in config.session_budgets_usd.items():
            self.set_budget("session", ident, usd)

    # --- lifecycle -----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        interrupted = self.store.recover()
        if interrupted:
            log.warning("%d calls were interrupted by a gateway that died: %s", len(interrupted), interrupted)
        connector = aiohttp.TCPConnector(limit=0, enable_cleanup_closed=False)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=True)

    async def close(self, grace_s: float = 30.0) -> None:
        """Let upstream calls in flight finish (up to `grace_s`), then close."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks))
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.store.close()

    async def drain(self) -> None:
        """Wait until no upstream call is in flight (tests and benchmarks)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    # --- runs, checkpoints, budgets (the integration API) --------------------------------------------------------

    def register_run(
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
        run = Run("run_" + secrets.token_hex(8), session_id, sandbox_id, api_key_id, checkpoint_id, mode,
                  parent_session_id, False, None, ip)
        self.store.create_run(run, token_hash(token), ip)
        self._tokens[token_hash(token)] = run
        self._states[run.run_id] = _RunState(run, 0)
        return token

    def end_run(self, token: str) -> None:
        """The run's sandbox instance is gone: its token is refused from now on and its address unbound."""
        run = self._token_run(token)
        if run is not None:
            self.store.end_run(run.run_id)
            self._states.pop(run.run_id, None)

    def run_of(self, token: str) -> Run | None:
        """The run a token was issued to, while it has not ended."""
        run = self._token_run(token)
        return None if run is None or self.store.run_ended(run.run_id) else run

    def sandbox_env(self, token: str, base_url: str) -> dict[str, str]:
        """Environment that points the official SDKs in a sandbox at this gateway."""
        base = base_url.rstrip("/")
        return {
            "OPENAI_BASE_URL": base + "/v1",
            "OPENAI_API_KEY": token,
            "ANTHROPIC_BASE_URL": base,
            "ANTHROPIC_API_KEY": token,
        }

    def mark_checkpoint(self, session_id: str, checkpoint_id: str, frozen_from: float | None = None,
                        frozen_until: float | None = None) -> int:
        """Record where the session's current run stood when checkpoint `checkpoint_id` froze its sandbox.

        Call it once the checkpoint is published, whatever the sandbox did since. `frozen_from`/`frozen_until`
        (`time.time()` just before and just after the sandbox was frozen for the image) bound the freeze; without
        them the mark is a wider window that the restored run's first call narrows by its body. Returns the
        lowest position the restored agent can make first."""
        run = self.store.active_run(session_id)
        if run is None:
            raise LookupError(f"session {session_id} has no active gateway run")
        positions = self.store.positions(run.run_id)
        floor = max((m.position for m in self.store.marks_of_run(run.run_id)), default=0)
        until = time.time() if frozen_until is None else frozen_until
        first, last = marks.window(positions, frozen_from, until, floor)
        self.store.put_mark(Mark(checkpoint_id, session_id, run.run_id, first, last))
        return first

    def set_budget(self, scope: BudgetScope, ident: str, limit_usd: float) -> None:
        if scope not in ("key", "session"):
            raise ValueError(f"budget scope must be 'key' or 'session', not {scope!r}")
        self.store.set_budget(scope, ident, round(limit_usd * NANO_PER_USD))

    def budget(self, scope: BudgetScope, ident: str) -> dict[str, float] | None:
        b = self.store.budget(scope, ident)
        return None if b is None else {k: b[f"{k}_nano"] / NANO_PER_USD for k in ("limit", "spent", "reserved")}

    def _token_run(self, token: str) -> Run | None:
        h = token_hash(token)
        run = self._tokens.get(h)
        if run is None:
            run = self.store.run_by_token_hash(h)
            if run is not None:
                self._tokens[h] = run
        return run

    def _state(self, run: Run) -> _RunState:
        state = self._states.get(run.run_id)
        if state is None:
            state = _RunState(run, self.store.next_ordinal(run.run_id), run.aligned_at)
            self._states[run.run_id] = state
        return state

    def lineage(self, session_id: str) -> tuple[str, ...]:
        """The session and the sessions it was forked from, nearest first."""
        chain = self._lineages.get(session_id)
        if chain is None:
            found = [session_id]
            while (parent := self.store.parent_session(found[-1])) is not None and parent not in found:
                found.append(parent)
            chain = self._lineages[session_id] = tuple(found)
        return chain

    def _caller(self, token: str | None, peer: str | None) -> _RunState:
        """The run a request belongs to: the one bound to its address, else the one its token was issued to."""
        token_run = self._token_run(token) if token else None
        if peer is not None:
            peer = normal_ip(peer)
            bound = self.store.bound_run(peer)
            if bound is not None:
                # The token only proves the caller is of this session's family; the address says which run.
                if token_run is None or token_run.session_id not in self.lineage(bound.session_id):
                    raise errors.unauthenticated()
                return self._state(bound)
            if (token_run is not None and token_run.source_ip is not None and token_run.source_ip != peer
                    and peer not in HOST_PEERS):
                raise BindingPending(peer)
        if token_run is None or self.store.run_ended(token_run.run_id):
            raise errors.unauthenticated()
        return self._state(token_run)

    # --- calls ---------------------------------------------------------------------------------------------------

    def authenticate(self, token: str | None, peer: str | None = None) -> Run:
        """The caller's run; raises GatewayError (401, or BindingPending) otherwise."""
        return self._caller(token, peer).run

    async def authenticate_waiting(self, token: str | None, peer: str | None = None) -> Run:
        """`authenticate`, waiting up to `binding_wait_s` for a just-restored sandbox instance to be bound."""
        deadline = time.monotonic() + self.config.binding_wait_s
        while True:
            try:
                return self.authenticate(token, peer)
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

    def begin(self, req: CallRequest) -> Answer:
        """Decide how to answer one call; everything up to the upstream request happens here, synchronously, so
        that ordinals follow arrival order."""
        state = self._caller(req.token, req.peer)
        run = state.run
        provider = self.route(req.endpoint, req.body.get("model"))
        digest = callkey.body_hash(req.endpoint, req.body)
        key, ordinal, delivers = self._resolve(state, req, digest)
        attempt = Attempt(key, run, provider.name, str(req.body["model"]), req.endpoint, now())

        live = self._inflight.get(key)
        if live is not None:
            self._add_position(run, ordinal, key, digest, "joined")
            live.joiners.append(attempt)
            return Answer(key, "joined", live=live, run_id=run.run_id, ordinal=ordinal, delivers=delivers)

        stored = self.store.call(key)
        if stored is not None and stored.status == "done" and stored.response is not None:
            self._add_position(run, ordinal, key, digest, "store")
            self.store.record_served("store", attempt, stored.ok_entry_id, stored.http_status)
            hide = providers.hides_usage(req.endpoint, req.body, stored.stream)
            return Answer(
                key, "store", status=stored.http_status or 200, content_type=stored.content_type or "application/json",
                chunks=stored_chunks(stored.endpoint, stored.stream, stored.response, hide),
                request_id=stored.upstream_request_id, run_id=run.run_id, ordinal=ordinal, delivers=delivers,
            )
        if stored is not None and stored.status == "inflight" and stored.owner is not None:
            if owner_alive(stored.owner, self.store.owner):
                raise errors.in_progress_elsewhere()
            self.store.recover()
        return self._go_upstream(req, attempt, provider, digest, ordinal, delivers)

    def _resolve(self, state: _RunState, req: CallRequest, digest: str) -> tuple[str, int | None, int | None]:
        """The call key, the new ordinal (None for a retry, which takes none), and the position answered."""
        run = state.run
        retrying = callkey.retry_count(req.headers.get("x-stainless-retry-count")) > 0
        idem = req.headers.get("idempotency-key")
        previous = self.store.latest_position_with_hash(run.run_id, digest) if retrying else None
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
        if key in self._inflight or self.store.call(key) is not None or run.checkpoint_id is None:
            return key, ordinal, ordinal
        mark = self.store.mark(run.checkpoint_id)
        if mark is None or mark.run_id == run.run_id:
            return key, ordinal, ordinal
        if not (mark.session_id == run.session_id
                or (run.mode == "replay" and mark.session_id == run.parent_session_id)):
            return key, ordinal, ordinal
        source = self._source_position(state, mark, ordinal, digest)
        if source is None:
            return key, ordinal, ordinal
        if source.body_hash == digest:
            return source.call_key, ordinal, ordinal
        self.store.record_divergence(run.run_id, ordinal, source, digest)
        return key, ordinal, ordinal

    def _source_position(self, state: _RunState, mark: Mark, ordinal: int, digest: str) -> Position | None:
        """The call of the marked run that this run's call `ordinal` makes again (if the bodies agree)."""
        if state.aligned is None:
            last = mark.position if mark.last_position is None else mark.last_position
            if ordinal >= marks.ALIGN_ATTEMPTS or last == mark.position:
                self._align(state, mark.position)  # nothing to choose from, or nothing re-issued: settle
            else:
                source = {p.ordinal: p for p in self.store.positions(mark.run_id)}
                found = marks.align(source, ordinal, digest, mark.position, last)
                if found is None:
                    return source.get(mark.position + ordinal)  # compared with the earliest candidate
                self._align(state, found)
                return source[found + ordinal]
        assert state.aligned is not None
        return self.store.position(mark.run_id, state.aligned + ordinal)

    def _align(self, state: _RunState, offset: int) -> None:
        state.aligned = offset
        self.store.set_aligned(state.run.run_id, offset)

    def _take_ordinal(self, state: _RunState) -> int:
        ordinal = state.next_ordinal
        state.next_ordinal += 1
        return ordinal

    def _add_position(self, run: Run, ordinal: int | None, key: str, digest: str, source: str) -> None:
        if ordinal is not None:
            # A refused call is answered at once, and finally (429 without retry): the agent moves on.
            self.store.add_position(Position(run.run_id, ordinal, key, digest, source, source == "refused"))

    def _go_upstream(
        self, req: CallRequest, attempt: Attempt, provider: ProviderConfig, digest: str, ordinal: int | None,
        delivers: int | None,
    ) -> Answer:
        run = attempt.run
        scopes = [("session", run.session_id)] + ([("key", run.api_key_id)] if run.api_key_id else [])
        applicable = [s for s in scopes if self.store.budget(*s) is not None]
        amount, cap_field = 0, None
        if applicable:
            price = self.prices.price(attempt.model)
            if price is None:
                self._add_position(run, ordinal, attempt.call_key, digest, "refused")
                raise GatewayError(429, "budget", f"Model {attempt.model} has no price, and a budget applies.",
                                   headers={"x-should-retry": "false"})
            worst = budget.worst_case(req.endpoint, req.body, len(req.raw), self.config.default_max_output_tokens)
            amount, cap_field = price.worst_case_nano(worst.input_tokens, worst.output_tokens), worst.cap_field
        position = None if ordinal is None else Position(run.run_id, ordinal, attempt.call_key, digest, "upstream",
                                                         False)
        try:
            self.store.begin_upstream(attempt, req.stream, digest, position, applicable, amount)
        except BudgetRefused as e:
            self._add_position(run, ordinal, attempt.call_key, digest, "refused")
            raise errors.over_budget(e.scope, e.ident) from None
        upstream = providers.build(provider, req.endpoint, req.body, req.raw, req.headers, req.stream, cap_field,
                                   self.config.default_max_output_tokens)
        live = InflightCall(attempt.call_key, req.endpoint, req.stream)
        self._inflight[attempt.call_key] = live
        assert self._session is not None, "Gateway.start() was not called"
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.config.upstream_connect_timeout_s, sock_read=self.config.upstream_timeout_s
        )
        job = UpstreamCall(live, attempt, provider, upstream, self.store, self.prices, self._session, timeout,
                           self._finished)
        job.reserved = bool(applicable)
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
        """The client has the whole answer: a checkpoint taken from now on will not expect this call again."""
        if answer.delivers is not None:
            self.store.set_delivered(answer.run_id, answer.delivers)
