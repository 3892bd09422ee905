"""The sandboxes' resolver, on loopback: forwards to an upstream the test runs (UDP and TCP), refuses a sandbox whose
policy allows nothing (or an address no sandbox holds), and remembers which names resolved to which addresses."""

from __future__ import annotations

import asyncio
import socket
import struct

from dnslib import QTYPE, RR, A, DNSRecord  # type: ignore[import-untyped]

from keepstate.egress import policy
from keepstate.egress.resolver import Resolver, parse_upstream, system_upstreams


class Upstream(asyncio.DatagramProtocol):
    """A DNS server for `*.test` on 127.0.0.1: every name has one address."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        q = DNSRecord.parse(data)
        name = str(q.q.qname).rstrip(".")
        self.asked.append(name)
        reply = q.reply()
        if name in self.answers:
            reply.add_answer(RR(q.q.qname, QTYPE.A, rdata=A(self.answers[name]), ttl=60))
        self.transport.sendto(reply.pack(), addr)  # type: ignore[attr-defined]


async def ask_udp(port: int, name: str) -> DNSRecord:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, DNSRecord.question(name).pack())
        return DNSRecord.parse(await asyncio.wait_for(loop.sock_recv(sock, 65535), 5))
    finally:
        sock.close()


async def ask_tcp(port: int, name: str) -> DNSRecord:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = DNSRecord.question(name).pack()
    writer.write(struct.pack("!H", len(data)) + data)
    size = struct.unpack("!H", await reader.readexactly(2))[0]
    reply = DNSRecord.parse(await reader.readexactly(size))
    writer.close()
    return reply


async def test_forwards_refuses_and_remembers() -> None:
    loop = asyncio.get_running_loop()
    upstream = Upstream({"plain.test": "198.51.100.10", "other.test": "203.0.113.5"})
    transport, _ = await loop.create_datagram_endpoint(lambda: upstream, local_addr=("127.0.0.1", 0))
    up_port = transport.get_extra_info("sockname")[1]
    policies = {"127.0.0.1": policy.Policy()}
    resolver = Resolver(policies.get, [("127.0.0.1", up_port)])
    port = await resolver.start("127.0.0.1")
    try:
        r = await ask_udp(port, "plain.test")
        assert r.header.rcode == 0 and str(r.rr[0].rdata) == "198.51.100.10"
        r = await ask_tcp(port, "other.test")
        assert r.header.rcode == 0 and str(r.rr[0].rdata) == "203.0.113.5"
        assert resolver.memory.names_for("127.0.0.1", "198.51.100.10") == ["plain.test"]
        assert resolver.memory.addresses("127.0.0.1", "other.test") == {"203.0.113.5"}
        # A policy that allows nothing at all: refused at once, the upstream never asked.
        asked = len(upstream.asked)
        policies["127.0.0.1"] = policy.parse({}, allow_internet_access=False)
        assert (await ask_udp(port, "plain.test")).header.rcode == 5  # REFUSED
        policies["127.0.0.1"] = policy.parse({"denyOut": ["0.0.0.0/0"]})
        assert (await ask_tcp(port, "plain.test")).header.rcode == 5
        # An allow entry (an address or a name) is something: resolved.
        policies["127.0.0.1"] = policy.parse({"allowOut": ["plain.test"], "denyOut": ["0.0.0.0/0"]})
        assert (await ask_udp(port, "plain.test")).header.rcode == 0
        # An address that is no sandbox's: refused.
        del policies["127.0.0.1"]
        assert (await ask_udp(port, "plain.test")).header.rcode == 5
        assert len(upstream.asked) == asked + 1
        resolver.memory.forget("127.0.0.1")
        assert resolver.memory.names_for("127.0.0.1", "198.51.100.10") == []
    finally:
        await resolver.stop()
        transport.close()


async def test_a_dead_upstream_is_a_servfail_not_a_hang() -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))  # bound, never answering
    resolver = Resolver(lambda ip: policy.Policy(), [("127.0.0.1", sock.getsockname()[1])])
    port = await resolver.start("127.0.0.1")
    try:
        assert (await ask_udp(port, "plain.test")).header.rcode == 2  # SERVFAIL
    finally:
        await resolver.stop()
        sock.close()


def test_upstream_spellings(tmp_path) -> None:
    assert parse_upstream("198.51.100.53") == ("198.51.100.53", 53)
    assert parse_upstream("198.51.100.53:5353") == ("198.51.100.53", 5353)
    assert parse_upstream("[2001:db8::1]:53") == ("2001:db8::1", 53)
    conf = tmp_path / "resolv.conf"
    conf.write_text("# comment\nnameserver 198.51.100.53\nsearch test\nnameserver 203.0.113.53\n")
    assert system_upstreams(conf) == [("198.51.100.53", 53), ("203.0.113.53", 53)]
