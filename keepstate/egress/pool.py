"""Upstream connections kept open across a sandbox's intercepted connections (docs/design/network.md, "Upstream
pool").

Only connections the proxy itself opens for a host with header rules are pooled (spliced ones are the sandbox's own,
end to end). The relay gives one back only after a complete exchange: a length-delimited or chunked response whose
upstream did not say close, every byte it sent consumed (`Upstream.usable`). It is taken again only by the same
sandbox: the key is (source address, original address, port, SNI, SOCKS5 route), and the Policy object it was
opened under must still be the sandbox's (an update or a new sandbox in the slot makes another, so neither ever
sees it). Headers set from secrets are per request, so reuse carries no secret from one connection to the next;
never across sandboxes is what keeps one sandbox's requests off a connection another could have primed.

An idle connection is watched (`Watched`): any byte, EOF or error from the upstream drops it at once; so does its
idle timeout (POOL_IDLE_S, or less when the upstream announced `Keep-Alive: timeout=N`). Bounds: PER_KEY idle per
key, PER_SOURCE per sandbox, TOTAL in all; the oldest goes first. Not thread-safe: the proxy's loop owns it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from keepstate.egress.pipe import Side
from keepstate.egress.policy import EgressProxy, Policy

log = logging.getLogger(__name__)

POOL_IDLE_S = 30.0
IDLE_MARGIN_S = 1.0  # given back this much before the upstream's own announced timeout
PER_KEY = 8
PER_SOURCE = 32
TOTAL = 512


class Watched(asyncio.StreamReaderProtocol):
    """A stream protocol that counts what the upstream sent and calls `on_activity` (once) when it sends, ends or
    fails: how an idle connection is seen to be gone, and how the relay tells that it consumed every byte."""

    def __init__(self, reader: asyncio.StreamReader, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(reader, loop=loop)
        self.received = 0
        self.on_activity: Callable[[], None] | None = None

    def _stir(self) -> None:
        cb, self.on_activity = self.on_activity, None
        if cb is not None:
            cb()

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        super().data_received(data)
        self._stir()

    def eof_received(self) -> bool:
        keep_open = bool(super().eof_received())
        self._stir()
        return keep_open

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._stir()


@dataclass(eq=False)
class Upstream:
    """One connection to an upstream as the relay uses it: `consumed` is what the relay has read of it, `exchanges`
    the responses it has carried (a connection that has carried one may have been closed by its server meanwhile:
    a request that meets that is retried once on a new connection, see relay.py)."""

    side: Side
    protocol: Watched
    consumed: int = 0
    exchanges: int = 0
    idle_s: float = POOL_IDLE_S

    def usable(self) -> bool:
        """Open, not at EOF, nothing sent that the relay has not read."""
        return (not self.side.writer.transport.is_closing() and not self.side.reader.at_eof()
                and self.side.reader.exception() is None and self.protocol.received == self.consumed)

    def got(self, n: int) -> None:
        self.consumed += n

    def close(self) -> None:
        """Close without waiting (a TLS connection still says close_notify)."""
        with contextlib.suppress(Exception):
            self.side.writer.close()


@dataclass(frozen=True)
class Key:
    source: str
    ip: str
    port: int
    sni: str | None
    route: EgressProxy | None = field(repr=False)  # the SOCKS5 upstream: its credentials never in a repr


@dataclass(eq=False)
class _Idle:
    key: Key
    policy: Policy
    conn: Upstream
    timer: asyncio.TimerHandle | None = None


class UpstreamConnections:
    """The egress proxy's idle connections to the internet's hosts, reused across a sandbox's connections, bounded
    per key, per source and in all."""

    def __init__(self, idle_s: float = POOL_IDLE_S, per_key: int = PER_KEY, per_source: int = PER_SOURCE,
                 total: int = TOTAL) -> None:
        self.idle_s, self.per_key, self.per_source, self.total = idle_s, per_key, per_source, total
        self._by_key: dict[Key, list[_Idle]] = {}
        self._order: OrderedDict[_Idle, None] = OrderedDict()  # oldest first
        self._per_source: dict[str, int] = {}

    def take(self, key: Key, policy: Policy) -> Upstream | None:
        """An idle connection for `key` opened under this very `policy`, newest first; None if there is none."""
        entries = self._by_key.get(key)
        while entries:
            entry = entries[-1]
            self._remove(entry)
            if entry.policy is policy and entry.conn.usable():
                return entry.conn
            entry.conn.close()
        return None

    def put(self, key: Key, policy: Policy, conn: Upstream) -> bool:
        """Keep `conn` idle for the next connection of the same key; False (and closed) when it cannot be kept."""
        idle_s = min(self.idle_s, conn.idle_s)
        if idle_s <= 0 or not conn.usable() or self.total <= 0:
            conn.close()
            return False
        entry = _Idle(key, policy, conn)
        self._by_key.setdefault(key, []).append(entry)
        self._order[entry] = None
        self._per_source[key.source] = self._per_source.get(key.source, 0) + 1
        entry.timer = asyncio.get_running_loop().call_later(idle_s, self._drop, entry)
        conn.protocol.on_activity = lambda: self._drop(entry)
        if len(self._by_key[key]) > self.per_key:
            self._drop(self._by_key[key][0])
        if self._per_source[key.source] > self.per_source:
            self._drop(next(e for e in self._order if e.key.source == key.source))
        if len(self._order) > self.total:
            self._drop(next(iter(self._order)))
        return True

    def drop(self, source: str) -> int:
        """Close every idle connection of one sandbox (its policy changed, it is going away); how many."""
        gone = [e for e in self._order if e.key.source == source]
        for e in gone:
            self._drop(e)
        return len(gone)

    def close(self) -> None:
        """Reset every idle connection (the proxy stops)."""
        for e in list(self._order):
            self._remove(e)
            e.conn.side.reset()

    def idle(self, source: str | None = None) -> int:
        """Idle connections held (of one sandbox, or in all)."""
        return len(self._order) if source is None else self._per_source.get(source, 0)

    def _drop(self, entry: _Idle) -> None:
        if entry in self._order:
            self._remove(entry)
            entry.conn.close()

    def _remove(self, entry: _Idle) -> None:
        self._order.pop(entry, None)
        entries = self._by_key.get(entry.key, [])
        if entry in entries:
            entries.remove(entry)
            if not entries:
                del self._by_key[entry.key]
            left = self._per_source[entry.key.source] - 1
            if left:
                self._per_source[entry.key.source] = left
            else:
                del self._per_source[entry.key.source]
        if entry.timer is not None:
            entry.timer.cancel()
        entry.conn.protocol.on_activity = None
