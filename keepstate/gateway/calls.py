"""One upstream request in flight: read to the end whatever happens to the clients, stored, shared with joiners."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp

from keepstate.db.errors import DatabaseUnavailable
from keepstate.db.repos.ledger import Attempt, Ledger
from keepstate.gateway import errors, providers
from keepstate.gateway.config import ProviderConfig
from keepstate.gateway.errors import GatewayError
from keepstate.gateway.prices import PriceTable
from keepstate.gateway.sse import SseSplitter, split_all
from keepstate.gateway.usage import StreamUsage, Usage, event_payload, from_response

log = logging.getLogger("keepstate.gateway")

# How long a finished call's outcome is retried while the database is unavailable (the call stays in flight
# meanwhile, and its clients wait): the provider has answered, and billed, so the outcome must not be lost.
STORE_RETRY_S = 120.0


@dataclass
class Chunk:
    data: bytes
    visible: bool


@dataclass
class InflightCall:
    """The shared, growing answer to one call key. The upstream task appends; relays read from any index."""

    key: str
    endpoint: str
    stream: bool
    status: int | None = None
    content_type: str | None = None
    request_id: str | None = None
    chunks: list[Chunk] = field(default_factory=list)
    error: GatewayError | None = None  # no upstream answer at all (unreachable, timeout before headers)
    broken: bool = False  # the upstream stream ended early: relays must cut their clients off too
    finished: bool = False
    entry_id: int | None = None
    joiners: list[Attempt] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_headers(self) -> None:
        while self.status is None and self.error is None and not self.finished:
            await self._changed.wait()

    async def follow(self) -> AsyncIterator[bytes]:
        """Every visible chunk from the first, as they arrive, until the call is finished."""
        i = 0
        while True:
            while i < len(self.chunks):
                chunk = self.chunks[i]
                i += 1
                if chunk.visible:
                    yield chunk.data
            if self.finished:
                return
            await self._changed.wait()

    def body(self) -> bytes:
        return b"".join(c.data for c in self.chunks if c.visible)


class UpstreamCall:
    """Runs one upstream request for an InflightCall and stores its outcome; never cancelled by a client."""

    def __init__(
        self, call: InflightCall, attempt: Attempt, provider: ProviderConfig, request: providers.UpstreamRequest,
        ledger: Ledger, prices: PriceTable, session: aiohttp.ClientSession, timeout: aiohttp.ClientTimeout,
        on_done: Callable[[InflightCall], None],
    ) -> None:
        self.call, self.attempt, self.provider, self.request = call, attempt, provider, request
        self.ledger, self.prices, self.session, self.timeout, self.on_done = ledger, prices, session, timeout, on_done
        self._raw: list[bytes] = []

    async def run(self) -> None:
        call = self.call
        outcome, usage = "error", None
        try:
            async with self.session.post(
                self.request.url, data=self.request.body, headers=self.request.headers, timeout=self.timeout
            ) as resp:
                call.status = resp.status
                call.content_type = resp.headers.get("content-type", "application/json")
                call.request_id = providers.request_id(self.provider.kind, resp.headers)
                call.notify()
                if resp.status == 200 and call.stream:
                    outcome, usage, held = await self._relay_stream(resp)
                else:
                    body = await resp.read()
                    self._raw.append(body)
                    if resp.status == 200:
                        outcome, usage = "ok", _usage_of(call.endpoint, body)
                    held = [Chunk(body, True)]
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            held = []
            if call.status is None:
                call.error = (
                    errors.upstream_timeout(self.provider.name)
                    if isinstance(e, asyncio.TimeoutError)
                    else errors.upstream_unreachable(self.provider.name, type(e).__name__)
                )
                outcome = "timeout" if isinstance(e, asyncio.TimeoutError) else "unreachable"
            else:
                outcome = "broken"
        except BaseException:
            # Cancellation only happens at gateway shutdown: the call stays `inflight` and is recovered as
            # interrupted by the next gateway that starts, or taken over by the one its retry reaches.
            if call.status is None:
                call.error = errors.stopping()
            call.broken = call.finished = True
            call.notify()
            raise
        try:
            await self._store(outcome, usage)
        finally:
            call.chunks.extend(held)
            call.broken = outcome == "broken"
            call.finished = True
            call.notify()
            self.on_done(call)

    async def _relay_stream(self, resp: aiohttp.ClientResponse) -> tuple[str, Usage | None, list[Chunk]]:
        call, splitter = self.call, SseSplitter()
        acc = StreamUsage(call.endpoint)
        held: list[Chunk] = []
        async for data in resp.content.iter_any():
            self._raw.append(data)
            added = False
            for ev in splitter.feed(data):
                payload = event_payload(ev.data) if b"usage" in ev.data else None
                if payload is not None:
                    acc.feed(payload)
                chunk = Chunk(ev.raw, not providers.hidden(self.request.hide_usage_chunk, payload))
                if held or providers.is_terminal(call.endpoint, ev.event, ev.data):
                    held.append(chunk)
                else:
                    call.chunks.append(chunk)
                    added = True
            if added:
                call.notify()
        complete = bool(held) or call.endpoint not in ("chat", "messages", "responses")
        return ("ok" if complete else "broken"), acc.usage, held

    async def _store(self, outcome: str, usage: Usage | None) -> None:
        call, ok = self.call, outcome == "ok"
        cost = self.prices.cost_nano(self.attempt.model, usage) if usage else 0
        response = b"".join(self._raw)
        delay, deadline = 0.1, time.monotonic() + STORE_RETRY_S
        while True:
            try:
                # Billed once: a retry after a commit whose answer was lost finds the call finished (None).
                entry_id = await self.ledger.finish_upstream(
                    self.attempt, ok=ok, outcome=outcome, http_status=call.status, content_type=call.content_type,
                    response=response, usage=usage.to_dict() if usage else None, request_id=call.request_id,
                    cost_nano=cost or 0, priced=cost is not None,
                )
                break
            except DatabaseUnavailable as e:
                if time.monotonic() >= deadline:
                    raise
                log.warning("call %s: storing its outcome failed, retrying: %s", call.key, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        if entry_id is None:
            log.warning("call %s was finished already (recovered by another gateway?): not billed again", call.key)
        call.entry_id = entry_id
        for joiner in call.joiners:
            await self.ledger.record_served("joined", joiner, call.entry_id, call.status)


def _usage_of(endpoint: str, body: bytes) -> Usage | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return from_response(endpoint, parsed) if isinstance(parsed, dict) else None


def stored_chunks(endpoint: str, stream: bool, body: bytes, hide_usage_chunk: bool) -> list[bytes]:
    """A stored answer, as the client that asked this body should see it."""
    if not stream:
        return [body]
    out = []
    for ev in split_all(body):
        payload = event_payload(ev.data) if b"usage" in ev.data else None
        if not providers.hidden(hide_usage_chunk, payload):
            out.append(ev.raw)
    return out


def now() -> float:
    return time.time()
