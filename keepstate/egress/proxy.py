"""The transparent egress proxy: every TCP connection of a sandbox whose policy `needs_proxy` (docs/design/network.md,
"Egress proxy").

The datapath dnats those connections to this listener; per connection the proxy
1. finds the sandbox's policy by the source address and the original destination (SO_ORIGINAL_DST), and resets
   what the always-denied guard covers;
2. peeks (without consuming) the first bytes: a ClientHello's SNI or an HTTP/1 Host (`sniff.py`);
3. decides with `Policy.ip_verdict` / `domain_allowed` ("name" needs a matching SNI/Host, else reset);
4. dials the original address (never a re-resolved name), directly or through the policy's SOCKS5 upstream
   (`socks5.py`; fail closed);
5. for a host with header rules parses its requests and sets the headers (`relay.py`, `http1.py`), terminating TLS
   with a leaf from the egress CA and re-encrypting to the verified upstream over a connection of the sandbox's
   own pool (`pool.py`) when one is idle; every other connection is spliced untouched.
Refusals are resets (SO_LINGER 0), as the kernel's reject would be. A secret's value exists only in the request
head sent upstream: the log names hosts and header names, the proxy's own answers name secrets, never values.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from keepstate.egress import socks5
from keepstate.egress.ca import CA
from keepstate.egress.http1 import MAX_HEAD, Answer, Request, set_rule_headers
from keepstate.egress.pipe import Side, reset_socket, splice
from keepstate.egress.policy import HeaderRule, Policy
from keepstate.egress.pool import Key, Upstream, UpstreamConnections, Watched
from keepstate.egress.relay import relay
from keepstate.egress.sniff import Sniffed, final, sniff

log = logging.getLogger(__name__)

SO_ORIGINAL_DST = 80
PEEK_BYTES = 16384
PEEK_S = 0.3
PEEK_MORE_S = 5.0
CONNECT_S = 10.0
LEAF_CACHE = 1024
BACKLOG = 4096


class Refused(Exception):
    """The connection is refused by policy or cannot be served: reset it."""


def so_original_dst(sock: socket.socket) -> tuple[str, int]:
    """Where a dnat'd connection was going (netfilter's SO_ORIGINAL_DST: a struct sockaddr_in)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    return socket.inet_ntoa(raw[4:8]), int.from_bytes(raw[2:4], "big")


def _nothing(*_: object) -> None:
    return None


class Proxy:
    def __init__(self, *, lookup: Callable[[str], Policy | None],
                 secret_value: Callable[[str], Awaitable[str | None]],
                 ca: CA, upstream_trust: ssl.SSLContext, guard: Callable[[str], bool],
                 on_bytes: Callable[[str, int, int], None] = _nothing,
                 on_host: Callable[[str, str], None] = _nothing,
                 original_dst: Callable[[socket.socket], tuple[str, int]] = so_original_dst,
                 max_connections: int = 0,
                 resolved: Callable[[str, str, str], bool] | None = None,
                 pool: UpstreamConnections | None = None) -> None:
        """`max_connections` > 0 caps one sandbox's concurrent proxied connections (`serve
        --egress-max-connections`: the forward chain's `ct count` never sees these, they end at the proxy).
        `resolved(source, name, ip)`: whether the sandbox's resolver answered `name` with `ip`; given, a secret
        travels in plain HTTP only to such an address (see `_rewriter`). `pool`: where upstream connections of
        intercepted hosts wait for the sandbox's next connection (default: UpstreamConnections' own bounds)."""
        self.lookup, self.secret_value, self.ca, self.upstream_trust = lookup, secret_value, ca, upstream_trust
        self.guard, self.on_bytes, self.on_host, self.original_dst = guard, on_bytes, on_host, original_dst
        self.max_connections, self.resolved = max_connections, resolved
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._by_source: dict[str, set[asyncio.Task[None]]] = {}
        self._leaves: OrderedDict[str, asyncio.Future[ssl.SSLContext]] = OrderedDict()
        self.pool = pool if pool is not None else UpstreamConnections()
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._accepting = asyncio.create_task(self._accept(sock), name="egress-proxy-accept")

    @property
    def address(self) -> tuple[str, int]:
        assert self._sock is not None, "the proxy is not started"
        host, port = self._sock.getsockname()[:2]
        return host, port

    @property
    def connections(self) -> int:
        """Connections being served now (tests check it returns to 0: no task outlives its connection)."""
        return sum(len(ts) for ts in self._by_source.values())

    async def stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        tasks = [t for ts in self._by_source.values() for t in ts]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for f in self._leaves.values():
            f.cancel()
        self._leaves.clear()
        self.pool.close()

    def cut(self, source: str) -> int:
        """Reset every connection of one sandbox (its policy changed or it is going away), and close its idle
        upstream connections; how many connections there were."""
        self.pool.drop(source)
        tasks = self._by_source.get(source, set())
        for t in tasks:
            t.cancel()
        return len(tasks)

    def forget(self, source: str) -> None:
        """Close the idle upstream connections of the sandbox at `source` (its policy changed to one that denies
        nothing more). Callable from any thread: the egress service's attach/update/detach run in one."""
        self._soon(self.pool.drop, source)

    def cut_soon(self, source: str) -> None:
        """`cut`, from any thread: a policy that may deny more, or the sandbox stopped or its slot is another's
        now. Scheduled on the proxy's loop before the caller returns, so it runs before the caller's answer."""
        self._soon(self.cut, source)

    def _soon(self, fn: Callable[[str], object], source: str) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            fn(source)
        else:
            loop.call_soon_threadsafe(fn, source)

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(sock)
            except OSError as e:  # EMFILE and the like: keep serving the connections already open
                log.warning("egress proxy: accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            _nodelay(conn)
            source = addr[0]
            if self.max_connections and len(self._by_source.get(source, ())) >= self.max_connections:
                log.info("egress %s: refused: over %d concurrent connections", source, self.max_connections)
                reset_socket(conn)
                continue
            task = asyncio.create_task(self._serve(conn, source))
            self._by_source.setdefault(source, set()).add(task)
            task.add_done_callback(functools.partial(self._done, source))

    def _done(self, source: str, task: asyncio.Task[None]) -> None:
        ts = self._by_source.get(source)
        if ts is not None:
            ts.discard(task)
            if not ts:
                del self._by_source[source]

    # --- one connection ----------------------------------------------------------------------------------------

    async def _serve(self, conn: socket.socket, source: str) -> None:
        sides: list[Side] = []
        raw: list[socket.socket] = [conn]
        ok = False
        try:
            await self._handle(conn, source, sides, raw)
            ok = True
        except Refused as e:
            log.info("egress %s: refused: %s", source, e)
        except asyncio.CancelledError:
            raise
        except (OSError, ssl.SSLError, EOFError, asyncio.IncompleteReadError, socks5.Socks5Error,
                TimeoutError, ConnectionError) as e:
            log.debug("egress %s: connection ended: %s: %s", source, type(e).__name__, e)
        except Exception:
            log.exception("egress %s: connection failed", source)
        finally:
            for s in raw:  # not yet handed to a transport (which then owns and closes it)
                reset_socket(s)
            try:
                for side in sides if ok else ():
                    with contextlib.suppress(Exception):
                        await side.close()
            finally:  # a failure, or a close cut short (stop, cut): reset what is still open
                for side in sides:
                    side.reset()

    async def _handle(self, conn: socket.socket, source: str, sides: list[Side], raw: list[socket.socket]) -> None:
        policy = self.lookup(source)
        if policy is None:
            raise Refused("no sandbox has this address")
        try:
            ip, port = self.original_dst(conn)
        except OSError as e:
            raise Refused(f"no original destination ({e})") from None
        if (ip, port) == tuple(conn.getsockname()[:2]):
            raise Refused("not redirected (its original destination is the proxy itself)")  # never dial ourselves
        if self.guard(ip):
            raise Refused(f"{ip} is always denied")
        seen = final(await self._peek(conn))
        verdict = policy.ip_verdict(ip)
        if verdict == "deny" or (verdict == "name" and not (seen.host and policy.domain_allowed(seen.host))):
            raise Refused(f"{seen.host or ip}:{port} is not allowed by the policy")
        if seen.host:
            self._report(self.on_host, source, seen.host)
        name = seen.host or ip
        rules = (policy.rules_for(name) or policy.rules_for(ip)) if seen.kind != "opaque" else ()
        # plain HTTP whose Host the peek did not see (a slow head): parse it anyway, each request's Host decides
        intercept = bool(rules) or (seen.kind == "http" and seen.host is None and bool(policy.rules))
        up: Callable[[int], None] = lambda n: self._report(self.on_bytes, source, n, 0)  # noqa: E731
        down: Callable[[int], None] = lambda n: self._report(self.on_bytes, source, 0, n)  # noqa: E731
        if not intercept:
            up_sock = await self._dial(policy, ip, port)
            raw.append(up_sock)
            log.debug("egress %s → %s:%d (%s): spliced", source, name, port, seen.kind)
            client, upstream = await _own(raw, conn, _plain(conn)), await _own(raw, up_sock, _plain(up_sock))
            sides += [client, upstream]
            await splice(client, upstream, up, down)
            return
        tls_name = name if seen.kind == "tls" else None
        key = Key(source, ip, port, tls_name, policy.egress_proxy)
        kept = self.pool.take(key, policy)
        log.debug("egress %s → %s:%d (%s): header rules, %s upstream connection", source, name, port, seen.kind,
                  "a kept" if kept else "a new")
        # the upstream first: if it fails, the sandbox's handshake is reset, not answered
        up_conn = kept if kept is not None else await self._upstream(policy, ip, port, tls_name)
        try:
            if tls_name is not None:
                leaf = await self._leaf(tls_name)
                client = await _own(raw, conn, _tls_server(conn, leaf))
            else:
                client = await _own(raw, conn, _plain(conn))
        except BaseException:
            up_conn.side.reset()
            raise
        sides.append(client)

        def give_back(c: Upstream) -> None:
            if self.pool.put(key, policy, c):
                log.debug("egress %s → %s:%d: upstream connection kept for the next", source, name, port)

        await relay(client, up_conn, self._rewriter(source, policy, seen, ip, rules), up, down,
                    reopen=lambda: self._upstream(policy, ip, port, tls_name), give_back=give_back)

    def _rewriter(self, source: str, policy: Policy, seen: Sniffed, ip: str,
                  rules: tuple[HeaderRule, ...]) -> Callable[[Request], Awaitable[None]]:
        """Each request's headers set. Over TLS the rules are the SNI's (the upstream proved that name); over plain
        HTTP each request's own Host picks them, and with a "name" verdict that Host must be allowed too. Plain
        HTTP proves nothing about the server, so with `resolved` a secret goes only to an address the sandbox's
        resolver gave for that name: else a sandbox could send `Host: api.example.com` to a server of its own."""
        named = policy.ip_verdict(ip) == "name"

        async def rewrite(req: Request) -> None:
            host, these = seen.host or ip, rules
            if seen.kind == "http":
                host = req.host or ip
                if named and not policy.domain_allowed(host):
                    raise Answer(403, f"the sandbox's network policy does not allow {host}")
                these = policy.rules_for(host)
                if these and self.resolved is not None and host != ip and any(r.secret_names() for r in these) \
                        and not self.resolved(source, host, ip):
                    raise Answer(502, f"the egress rule for {host} sends a secret, and over plain HTTP only to an "
                                      f"address the sandbox's resolver gave for {host}, which {ip} is not")
                these = these or policy.rules_for(ip)
            values = await self._secrets(host, {n for r in these for n in r.secret_names()})
            names = set_rule_headers(req, host, these, values.get)
            log.debug("egress %s → %s: %s %s, set %s", source, host, req.method, req.target.split("?")[0][:200],
                      ", ".join(names))

        return rewrite

    async def _secrets(self, host: str, names: set[str]) -> dict[str, str | None]:
        """The values a request needs (the store reads the database and decrypts)."""
        out: dict[str, str | None] = {}
        for n in sorted(names):
            try:
                out[n] = await self.secret_value(n)
            except Exception as e:  # the store's own error (a wrong key, no database): named, with no value in it
                log.error("egress: the secret %r for %s could not be read (%s)", n, host, type(e).__name__)
                raise Answer(502, f"the secret {n!r} that the egress rule for {host} uses could not be "
                                  f"read") from None
        return out

    def _report(self, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:  # accounting must not break the sandbox's traffic
            log.exception("egress proxy: a report callback failed")

    # --- peeking, dialing, certificates ------------------------------------------------------------------------

    async def _peek(self, conn: socket.socket) -> bytes:
        """The client's first bytes, left in the socket: read with MSG_PEEK, waiting (SO_RCVLOWAT one more than
        what is there, so readiness means new bytes or EOF) until they decide or fill PEEK_BYTES. A client silent
        for PEEK_S is opaque (a server-first protocol); one that has started a ClientHello or a request head gets
        PEEK_MORE_S to finish it (a slow or loaded client must not lose its header rules)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        data, seen = b"", -1
        try:
            while True:
                try:
                    data = conn.recv(PEEK_BYTES, socket.MSG_PEEK)
                    if not data:
                        return data  # EOF before a byte
                except BlockingIOError:
                    data = b""
                if data and (sniff(data) is not None or len(data) >= PEEK_BYTES):
                    return data
                if len(data) == seen:
                    return data  # readable without new bytes: the client's EOF
                seen = len(data)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, len(data) + 1)
                left = start + (PEEK_MORE_S if data else PEEK_S) - loop.time()
                if not await _readable(conn, max(left, 0.0)):
                    with contextlib.suppress(BlockingIOError):  # the loop may have been too busy to tell
                        data = conn.recv(PEEK_BYTES, socket.MSG_PEEK)
                    if data and sniff(data) is None and loop.time() - start < PEEK_MORE_S:
                        seen = -1
                        continue
                    return data
        finally:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)

    async def _dial(self, policy: Policy, ip: str, port: int) -> socket.socket:
        loop = asyncio.get_running_loop()
        proxy = policy.egress_proxy
        async with asyncio.timeout(CONNECT_S):
            if proxy is None:
                return await _connect(ip, port)
            infos = await loop.getaddrinfo(proxy.host, proxy.port, type=socket.SOCK_STREAM)
            addrs = [str(i[4][0]) for i in infos if not self.guard(str(i[4][0]))]
            if not addrs:
                raise Refused(f"the egress proxy {proxy.address} is not reachable (always-denied address)")
            sock = await _connect(addrs[0], proxy.port)
            try:
                await socks5.handshake(sock, proxy, ip, port)
            except BaseException:
                reset_socket(sock)
                raise
            return sock

    async def _upstream(self, policy: Policy, ip: str, port: int, tls_name: str | None) -> Upstream:
        """A new connection to the upstream of an intercepted host: dialed (direct or SOCKS5), then TLS verified
        for `tls_name` when it is one."""
        sock = await self._dial(policy, ip, port)
        return await _open_upstream(sock, self.upstream_trust if tls_name is not None else None, tls_name)

    async def _leaf(self, host: str) -> ssl.SSLContext:
        """The CA's context for `host`; the first issue per host runs in a thread (a few ms of signing), shared by
        the connections that ask meanwhile."""
        fut = self._leaves.get(host)
        if fut is None:
            fut = asyncio.ensure_future(asyncio.to_thread(self.ca.server_context, host))
            self._leaves[host] = fut
            while len(self._leaves) > LEAF_CACHE:
                self._leaves.popitem(last=False)
        else:
            self._leaves.move_to_end(host)
        try:
            return await asyncio.shield(fut)
        except Exception:
            if self._leaves.get(host) is fut:
                del self._leaves[host]
            raise


async def _own(raw: list[socket.socket], sock: socket.socket, wrap: Coroutine[Any, Any, Side]) -> Side:
    """Hand `sock` to the transport `wrap` makes: from then on the transport closes it, even if `wrap` fails."""
    raw.remove(sock)
    return await wrap


async def _readable(conn: socket.socket, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    fd = conn.fileno()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(fd, ready)
    try:
        await asyncio.wait_for(fut, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


def _nodelay(sock: socket.socket) -> None:
    """TCP_NODELAY, which asyncio sets only on sockets whose `proto` says TCP (ours say 0): without it a TLS
    record written after an unacknowledged one waits for the peer's delayed ACK (40 ms on Linux)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _connect(ip: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    _nodelay(sock)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (ip, port))
    except BaseException:
        sock.close()
        raise
    return sock


async def _plain(sock: socket.socket) -> Side:
    reader, writer = await asyncio.open_connection(sock=sock, limit=MAX_HEAD)
    return Side(reader, writer)


async def _open_upstream(sock: socket.socket, ctx: ssl.SSLContext | None, hostname: str | None) -> Upstream:
    """`sock` as an upstream stream whose protocol the pool can watch; from the call on its transport owns the
    socket (and closes it if the TLS handshake fails)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_HEAD, loop=loop)
    protocol = Watched(reader, loop)
    if ctx is None:
        transport, _ = await loop.create_connection(lambda: protocol, sock=sock)
    else:
        transport, _ = await loop.create_connection(lambda: protocol, sock=sock, ssl=ctx, server_hostname=hostname,
                                                    ssl_handshake_timeout=CONNECT_S)
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    return Upstream(Side(reader, writer, tls=ctx is not None), protocol)


async def _tls_server(sock: socket.socket, ctx: ssl.SSLContext) -> Side:
    """Server-side TLS on an accepted socket (what asyncio.start_server does per connection, for one socket)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_HEAD, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock=sock, ssl=ctx,
                                                      ssl_handshake_timeout=CONNECT_S)
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    return Side(reader, writer, tls=True)
