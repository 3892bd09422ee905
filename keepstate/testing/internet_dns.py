"""The fake internet's DNS server (UDP and TCP, dnslib): A records from a table, NXDOMAIN for any other name.

It is the upstream the servers under test forward to (`serve --dns-upstream`), so it is the only resolver a test
run ever reaches. Every query is logged (name, type, client) so tests can tell what the resolver under test asked.
"""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any

from dnslib import QTYPE, RCODE, RR, A, DNSError, DNSRecord  # type: ignore[import-untyped]

TTL = 60


def lookup(table: dict[str, str], name: str) -> str | None:
    """`name`'s address: its own entry, else that of the nearest wildcard above it (`*.example.test`)."""
    if name in table:
        return table[name]
    labels = name.split(".")
    for i in range(1, len(labels)):
        address = table.get("*." + ".".join(labels[i:]))
        if address is not None:
            return address
    return None


def answer(data: bytes, table: dict[str, str], log: list[dict[str, Any]], client: str) -> bytes | None:
    """The reply to one DNS message, or None for bytes that are not one (dropped, as a real server would)."""
    try:
        query = DNSRecord.parse(data)
    except (DNSError, ValueError, IndexError, struct.error):
        return None
    reply = query.reply()
    for q in query.questions:
        name = str(q.qname).rstrip(".").lower()
        log.append({"name": name, "type": QTYPE.get(q.qtype, str(q.qtype)), "client": client, "time": time.time()})
        address = lookup(table, name)
        if address is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif q.qtype in (QTYPE.A, QTYPE.ANY):
            reply.add_answer(RR(q.qname, QTYPE.A, rdata=A(address), ttl=TTL))
        # a known name asked for another type (AAAA...): NOERROR with no answer, as for a v4-only host
    return bytes(reply.pack())


class _UDP(asyncio.DatagramProtocol):
    def __init__(self, table: dict[str, str], log: list[dict[str, Any]]) -> None:
        self.table, self.log = table, log
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a selector transport, not a DatagramTransport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = answer(data, self.table, self.log, f"{addr[0]}:{addr[1]}")
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


async def _tcp(table: dict[str, str], log: list[dict[str, Any]], reader: asyncio.StreamReader,
               writer: asyncio.StreamWriter) -> None:
    peer = writer.get_extra_info("peername")
    try:
        while True:
            (length,) = struct.unpack("!H", await reader.readexactly(2))
            reply = answer(await reader.readexactly(length), table, log, f"{peer[0]}:{peer[1]}")
            if reply is None:
                return
            writer.write(struct.pack("!H", len(reply)) + reply)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        return
    finally:
        writer.close()


async def serve_dns(address: str, table: dict[str, str], log: list[dict[str, Any]],
                    port: int = 53) -> tuple[asyncio.DatagramTransport, asyncio.Server]:
    loop = asyncio.get_running_loop()
    udp, _ = await loop.create_datagram_endpoint(lambda: _UDP(table, log), local_addr=(address, port))

    async def on_tcp(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _tcp(table, log, r, w)

    tcp = await asyncio.start_server(on_tcp, address, port, reuse_address=True)
    return udp, tcp
