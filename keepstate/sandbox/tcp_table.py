"""The host's TCP table, read for one sandbox: which connections to it are not closed yet.

A connection the host closes is closed in the sandbox only once the sandbox's netstack has answered the FIN. Two
things must not begin before that: an idle freeze (a connection closed while frozen leaves the host's FIN
unanswered, retransmitted for minutes into the slot's address) and a checkpoint (a connection left half-closed in
the image is restored as one more endpoint on its listener's port, and gVisor 20240729 can then restore that
listener in a state that refuses every connection: docs/design/sandbox-lifecycle.md, "Fork readiness").
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Callable, Iterable

from keepstate.agent.listening import read_tables

QUIET = {"06", "07"}  # TIME_WAIT, CLOSE


def _hex_v4(address: str) -> str:
    """An IPv4 address as /proc/net/tcp prints it (the 32-bit word in host byte order, hex)."""
    return f"{struct.unpack('=I', socket.inet_aton(address))[0]:08X}"


def open_tcp(address: str, tables: Iterable[str]) -> list[str]:
    """The states (hex, as /proc/net/tcp writes them) of sockets whose remote address is `address`, other than
    TIME_WAIT and CLOSE, in the text of /proc/net/tcp and tcp6 tables (v4-mapped v6 addresses included)."""
    v4 = _hex_v4(address)
    mapped = "0000000000000000FFFF0000" + v4
    busy = []
    for text in tables:
        for line in text.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 4:
                continue
            remote, state = fields[2].partition(":")[0].upper(), fields[3].upper()
            if remote in (v4, mapped) and state not in QUIET:
                busy.append(state)
    return busy


def host_tcp_open(address: str) -> list[str]:
    """open_tcp over this process's network namespace (the host's end of every sandbox's veth)."""
    return open_tcp(address, read_tables())


async def settled(address: str, within: float, every: float,
                  probe: Callable[[str], list[str]] = host_tcp_open) -> list[str]:
    """Until the host holds no TCP connection to `address` but closed ones, or `within` seconds pass (a loaded
    sandbox answers FINs late); the states still open then ([] once settled). Reads the table every `every` s."""
    deadline = time.monotonic() + within
    while True:
        await asyncio.sleep(every)
        left = probe(address)
        if not left or time.monotonic() >= deadline:
            return left
