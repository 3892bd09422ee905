"""The Gateway: runs and their tokens, call-key resolution, budgets, and the decision upstream / store / join.

The HTTP layer (keepstate.gateway.http) parses requests into `CallRequest`s and renders `Answer`s; this module
decides. Rules: docs/design/gateway.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from keepstate.gateway import budget, callkey, errors, providers
from keepstate.gateway.calls import InflightCall, UpstreamCall, now, stored_chunks
from keepstate.gateway.config import GatewayConfig, ProviderConfig
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
    ordinal: int | None = None


@dataclass
class _RunState:
    run: Run
    next_ordinal: int


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Gateway:
    """One per process. Safe to share its SQLite file with other processes (see the design doc)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.store = Store(config.db_path)
        self.prices = PriceTable.load(config.price_table)
        self._runs: dict[str, _RunState] = {}  # token hash -> state; the database is the authority
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
        mode: Mode = "diverge", parent_session_id: str | None = None,
    ) -> str:
        """Start a run of a session and return its bearer token (the sandbox's OPENAI_API_KEY/ANTHROPIC_API_KEY)."""
        if mode not in ("diverge", "replay"):
            raise ValueError(f"mode must be 'diverge' or 'replay', not {mode!r}")
        if mode == "replay" and (parent_session_id is None or checkpoint_id is None):
            raise ValueError("replay mode needs the parent session and the checkpoint the fork starts from")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        run = Run("run_" + secrets.token_hex(8), session_id, sandbox_id, api_key_id, checkpoint_id, mode,
                  parent_session_id, False)
        self.store.create_run(run, token_hash(token))
        self._runs[token_hash(token)] = _RunState(run, 0)
        return token

    def end_run(self, token: str) -> None:
        h = token_hash(token)
        state = self._run_state(token)
        if state is not None:
            self.store.end_run(state.run.run_id)
        self._runs.pop(h, None)

    def run_of(self, token: str) -> Run | None:
        state = self._run_state(token)
        return None if state is None else state.run

    def sandbox_env(self, token: str, base_url: str) -> dict[str, str]:
        """Environment that points the official SDKs in a sandbox at this gateway."""
        base = base_url.rstrip("/")
        return {
            "OPENAI_BASE_URL": base + "/v1",
            "OPENAI_API_KEY": token,
            "ANTHROPIC_BASE_URL": base,
            "ANTHROPIC_API_KEY": token,
        }

    def mark_checkpoint(self, session_id: str, checkpoint_id: str) -> int:
        """Record where the session's current run stands as checkpoint `checkpoint_id` is taken (call it while
        the sandbox is paused). Returns the position: the first call the restored agent will make again."""
        run = self.store.active_run(session_id)
        if run is None:
            raise LookupError(f"session {session_id} has no active gateway run")
        position = self.store.first_undelivered(run.run_id)
        if position is None:
            position = self.store.next_ordinal(run.run_id)
        self.store.put_mark(Mark(checkpoint_id, session_id, run.run_id, position))
        return position

    def set_budget(self, scope: BudgetScope, ident: str, limit_usd: float) -> None:
        if scope not in ("key", "session"):
            raise ValueError(f"budget scope must be 'key' or 'session', not {scope!r}")
        self.store.set_budget(scope, ident, round(limit_usd * NANO_PER_USD))

    def budget(self, scope: BudgetScope, ident: str) -> dict[str, float] | None:
        b = self.store.budget(scope, ident)
        return None if b is None else {k: b[f"{k}_nano"] / NANO_PER_USD for k in ("limit", "spent", "reserved")}

    def _run_state(self, token: str) -> _RunState | None:
        h = token_hash(token)
        state = self._runs.get(h)
        if state is not None and self.store.run_ended(state.run.run_id):  # ended by another process
            self._runs.pop(h, None)
            return None
        if state is None:
            run = self.store.run_by_token_hash(h)
            if run is None or run.ended:
                return None
            state = _RunState(run, self.store.next_ordinal(run.run_id))
            self._runs[h] = state
        return state

    # --- calls ---------------------------------------------------------------------------------------------------

    def authenticate(self, token: str | None) -> Run:
        state = self._run_state(token) if token else None
        if state is None:
            raise errors.unauthenticated()
        return state.run

    def route(self, endpoint: str, model: Any) -> ProviderConfig:
        if not isinstance(model, str) or not model:
            raise errors.invalid("you must provide a model parameter", "model")
        kind = "anthropic" if endpoint == "messages" else "openai"
        provider = self.config.provider_for(kind, model)
        if provider is None:
            raise errors.unknown_model(model)
        return provider

    def listed_models(self, kind: str) -> list[str]:
        return [m for p in self.config.providers if p.kind == kind for m in p.listed_models()]

    def begin(self, req: CallRequest) -> Answer:
        """Decide how to answer one call; everything up to the upstream request happens here, synchronously, so
        that ordinals follow arrival order."""
        state = self._run_state(req.token) if req.token else None
        if state is None:
            raise errors.unauthenticated()
        run = state.run
        provider = self.route(req.endpoint, req.body.get("model"))
        digest = callkey.body_hash(req.endpoint, req.body)
        key, ordinal = self._resolve(state, req, digest)
        attempt = Attempt(key, run, provider.name, str(req.body["model"]), req.endpoint, now())

        live = self._inflight.get(key)
        if live is not None:
            self._add_position(run, ordinal, key, digest, "joined")
            live.joiners.append(attempt)
            return Answer(key, "joined", live=live, run_id=run.run_id, ordinal=ordinal)

        stored = self.store.call(key)
        if stored is not None and stored.status == "done" and stored.response is not None:
            self._add_position(run, ordinal, key, digest, "store")
            self.store.record_served("store", attempt, stored.ok_entry_id, stored.http_status)
            hide = providers.hides_usage(req.endpoint, req.body, stored.stream)
            return Answer(
                key, "store", status=stored.http_status or 200, content_type=stored.content_type or "application/json",
                chunks=stored_chunks(stored.endpoint, stored.stream, stored.response, hide),
                request_id=stored.upstream_request_id, run_id=run.run_id, ordinal=ordinal,
            )
        if stored is not None and stored.status == "inflight" and stored.owner is not None:
            if owner_alive(stored.owner, self.store.owner):
                raise errors.in_progress_elsewhere()
            self.store.recover()
        return self._go_upstream(req, attempt, provider, digest, ordinal)

    def _resolve(self, state: _RunState, req: CallRequest, digest: str) -> tuple[str, int | None]:
        """The call key, and the new ordinal (None for a retry, which takes none)."""
        run = state.run
        retrying = callkey.retry_count(req.headers.get("x-stainless-retry-count")) > 0
        idem = req.headers.get("idempotency-key")
        if idem and not idem.startswith("stainless-"):  # SDK-made keys are random per request: not an identity
            key = callkey.idempotency_call_key(run.session_id, idem)
            if retrying and self.store.latest_position_with_hash(run.run_id, digest) is not None:
                return key, None
            return key, self._take_ordinal(state)
        if retrying:
            previous = self.store.latest_position_with_hash(run.run_id, digest)
            if previous is not None:
                return previous.call_key, None
        ordinal = self._take_ordinal(state)
        key = callkey.position_call_key(run.session_id, run.checkpoint_id, ordinal, digest)
        if key in self._inflight or self.store.call(key) is not None or run.checkpoint_id is None:
            return key, ordinal
        mark = self.store.mark(run.checkpoint_id)
        if mark is None or mark.run_id == run.run_id:
            return key, ordinal
        if not (mark.session_id == run.session_id or (run.mode == "replay" and mark.session_id == run.parent_session_id)):
            return key, ordinal
        source = self.store.position(mark.run_id, mark.position + ordinal)
        if source is None:
            return key, ordinal
        if source.body_hash == digest:
            return source.call_key, ordinal
        self.store.record_divergence(run.run_id, ordinal, source, digest)
        return key, ordinal

    def _take_ordinal(self, state: _RunState) -> int:
        ordinal = state.next_ordinal
        state.next_ordinal += 1
        return ordinal

    def _add_position(self, run: Run, ordinal: int | None, key: str, digest: str, source: str) -> None:
        if ordinal is not None:
            self.store.add_position(Position(run.run_id, ordinal, key, digest, source, False))

    def _go_upstream(
        self, req: CallRequest, attempt: Attempt, provider: ProviderConfig, digest: str, ordinal: int | None
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
        return Answer(attempt.call_key, "upstream", live=live, run_id=run.run_id, ordinal=ordinal)

    def _finished(self, call: InflightCall) -> None:
        self._inflight.pop(call.key, None)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("upstream call failed inside the gateway", exc_info=task.exception())

    def delivered(self, answer: Answer) -> None:
        """The client has the whole answer: a checkpoint taken from now on will not expect this call again."""
        if answer.ordinal is not None:
            self.store.set_delivered(answer.run_id, answer.ordinal)
