"""The sandboxes' DNS resolver: a forwarder on GATEWAY_IP (UDP and TCP), reached as GATEWAY_IP:53 through each
slot's dnat (egress/firewall.py), so a sandbox's /etc/resolv.conf is the same on every server and after a restore.

It refuses a sandbox whose policy allows nothing at all (its lookups fail fast instead of timing out), forwards the
rest to the upstreams (`serve --dns-upstream`, default the host's /etc/resolv.conf), and remembers per source
address which names resolved to which addresses: the egress proxy and the history name the host behind an address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from dnslib import QTYPE, RCODE, DNSRecord  # type: ignore[import-untyped]

from .policy import Policy

log = logging.getLogger("keepstate.egress")
UPSTREAM_TIMEOUT = 2.0
NAMES_PER_SOURCE = 4096
MAX_UDP = 4096


def parse_upstream(text: str) -> tuple[str, int]:
    """`IP`, `IP:PORT` or `[IPv6]:PORT`."""
    text = text.strip()
    if text.startswith("["):
        host, _, port = text[1:].partition("]:")
        return host, int(port or 53)
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, int(port)
    return text, 53


def system_upstreams(path: Path = Path("/etc/resolv.conf")) -> list[tuple[str, int]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    return [(parts[1], 53) for parts in (ln.split() for ln in lines) if len(parts) >= 2 and parts[0] == "nameserver"]


def allows_nothing(policy: Policy) -> bool:
    return policy.denies_all and not policy.allow_nets and not policy.allow_domains


class Memory:
    """name -> addresses per source address, newest kept (a bounded cache, not a record)."""

    def __init__(self) -> None:
        self._by_source: dict[str, OrderedDict[str, set[str]]] = {}

    def note(self, source: str, name: str, addresses: set[str]) -> None:
        names = self._by_source.setdefault(source, OrderedDict())
        names[name] = names.pop(name, set()) | addresses
        while len(names) > NAMES_PER_SOURCE:
            names.popitem(last=False)

    def names_for(self, source: str, address: str) -> list[str]:
        """The names a source looked up that resolved to `address`, newest first."""
        names: OrderedDict[str, set[str]] = self._by_source.get(source) or OrderedDict()
        return [n for n, addrs in reversed(names.items()) if address in addrs]

    def addresses(self, source: str, name: str) -> set[str]:
        names: OrderedDict[str, set[str]] = self._by_source.get(source) or OrderedDict()
        return set(names.get(name.lower().rstrip("."), set()))

    def forget(self, source: str) -> None:
        self._by_source.pop(source, None)


class Resolver:
    def __init__(self, policy_for: Callable[[str], Policy | None], upstreams: list[tuple[str, int]]) -> None:
        self.policy_for = policy_for
        self.upstreams = upstreams
        self.memory = Memory()
        self.port = 0
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on host:port (0: a free port, the same for UDP and TCP); returns the port."""
        loop = asyncio.get_running_loop()
        for _ in range(20):
            udp, _ = await loop.create_datagram_endpoint(lambda: _Udp(self), local_addr=(host, port))
            chosen: int = udp.get_extra_info("sockname")[1]
            try:
                self._tcp = await asyncio.start_server(self._serve_tcp, host, chosen)
            except OSError:
                udp.close()
                if port:
                    raise
                continue
            self._udp, self.port = udp, chosen
            return chosen
        raise OSError(f"no port on {host} free for both UDP and TCP")

    async def stop(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            with contextlib.suppress(Exception):
                await self._tcp.wait_closed()

    async def answer(self, data: bytes, source: str) -> bytes | None:
        """The reply to one query from `source`; None when it is not even a DNS query."""
        try:
            query = DNSRecord.parse(data)
        except Exception:
            return None
        policy = self.policy_for(source)
        if policy is None or allows_nothing(policy) or not self.upstreams:
            reply = query.reply()
            reply.header.rcode = RCODE.REFUSED
            return bytes(reply.pack())
        raw = await self._forward(data)
        if raw is None:
            reply = query.reply()
            reply.header.rcode = RCODE.SERVFAIL
            return bytes(reply.pack())
        self._remember(source, raw)
        return raw

    def _remember(self, source: str, raw: bytes) -> None:
        try:
            reply = DNSRecord.parse(raw)
        except Exception:
            return
        names: dict[str, set[str]] = {}
        alias: dict[str, str] = {}
        for rr in reply.rr:
            name = str(rr.rname).lower().rstrip(".")
            if rr.rtype == QTYPE.CNAME:
                alias[str(rr.rdata).lower().rstrip(".")] = name
            elif rr.rtype in (QTYPE.A, QTYPE.AAAA):
                while name in alias:  # the name asked for, not the CNAME's target
                    name = alias.pop(name)
                names.setdefault(name, set()).add(str(rr.rdata))
        for name, addrs in names.items():
            self.memory.note(source, name, addrs)

    async def _forward(self, data: bytes) -> bytes | None:
        loop = asyncio.get_running_loop()
        for host, port in self.upstreams:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_DGRAM)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, (host, port))
                await loop.sock_sendall(sock, data)
                raw = await asyncio.wait_for(loop.sock_recv(sock, 65535), UPSTREAM_TIMEOUT)
                if raw and _truncated(raw):
                    raw = await self._forward_tcp(host, port, data) or raw
                return raw
            except (TimeoutError, OSError) as exc:
                log.debug("DNS upstream %s:%d: %s", host, port, exc)
            finally:
                sock.close()
        return None

    async def _forward_tcp(self, host: str, port: int, data: bytes) -> bytes | None:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), UPSTREAM_TIMEOUT)
        except (TimeoutError, OSError):
            return None
        try:
            writer.write(struct.pack("!H", len(data)) + data)
            await writer.drain()
            size = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), UPSTREAM_TIMEOUT))[0]
            return await asyncio.wait_for(reader.readexactly(size), UPSTREAM_TIMEOUT)
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            return None
        finally:
            writer.close()

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        source = writer.get_extra_info("peername")[0]
        try:
            while True:
                size = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 30))[0]
                reply = await self.answer(await reader.readexactly(size), source)
                if reply is None:
                    break
                writer.write(struct.pack("!H", len(reply)) + reply)
                await writer.drain()
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def _truncated(raw: bytes) -> bool:
    return len(raw) > 2 and bool(raw[2] & 0x02)


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, resolver: Resolver) -> None:
        self.resolver = resolver
        self.transport: asyncio.DatagramTransport | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        task = asyncio.get_running_loop().create_task(self._reply(data, addr))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reply(self, data: bytes, addr: tuple[str | object, int]) -> None:
        reply = await self.resolver.answer(data, str(addr[0]))
        if reply is not None and self.transport is not None and not self.transport.is_closing():
            if len(reply) > MAX_UDP:
                with contextlib.suppress(Exception):
                    truncated = DNSRecord.parse(reply).truncate()
                    reply = bytes(truncated.pack())
            self.transport.sendto(reply, addr)
