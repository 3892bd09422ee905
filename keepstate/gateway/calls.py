"""One upstream request in flight: read to the end whatever happens to the clients, stored, shared with joiners."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp

from keepstate.gateway import errors, providers
from keepstate.gateway.config import ProviderConfig
from keepstate.gateway.errors import GatewayError
from keepstate.gateway.prices import PriceTable
from keepstate.gateway.sse import SseSplitter, split_all
from keepstate.gateway.store import Attempt, Store
from keepstate.gateway.usage import StreamUsage, Usage, event_payload, from_response


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
        store: Store, prices: PriceTable, session: aiohttp.ClientSession, timeout: aiohttp.ClientTimeout,
        on_done: Callable[[InflightCall], None],
    ) -> None:
        self.call, self.attempt, self.provider, self.request = call, attempt, provider, request
        self.store, self.prices, self.session, self.timeout, self.on_done = store, prices, session, timeout, on_done
        self._raw: list[bytes] = []
        self.reserved = True  # whether a budget reservation was made for this attempt (else nothing to settle)

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
            # interrupted by the next gateway to open the store.
            call.broken = call.finished = True
            call.notify()
            raise
        try:
            self._store(outcome, usage)
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

    def _store(self, outcome: str, usage: Usage | None) -> None:
        call, ok = self.call, outcome == "ok"
        cost = self.prices.cost_nano(self.attempt.model, usage) if usage else 0
        call.entry_id = self.store.finish_upstream(
            self.attempt, ok=ok, outcome=outcome, http_status=call.status, content_type=call.content_type,
            response=b"".join(self._raw), usage=usage, request_id=call.request_id, cost_nano=cost or 0,
            priced=cost is not None, reserved=self.reserved,
        )
        for joiner in call.joiners:
            self.store.record_served("joined", joiner, call.entry_id, call.status)


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
