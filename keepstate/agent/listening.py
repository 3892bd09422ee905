"""`GET /keepstate/listening` (the host's only; the router never relays it): the TCP ports that listen on an address
the host can reach (any but loopback), read from the sandbox's own /proc/net/tcp and tcp6.

The host asks just before a checkpoint and keeps the answer in the checkpoint's manifest: a sandbox restored from it
(a fork, a resume from the store) is handed out only once the same ports accept again (docs/design/sandbox-lifecycle.md,
"Fork readiness").
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

LISTEN = "0A"
TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def _address(hexed: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address as /proc/net/tcp{,6} prints it: 32-bit words in host byte order (little-endian here)."""
    try:
        raw = bytes.fromhex(hexed)
    except ValueError:
        return None
    if len(raw) not in (4, 16):
        return None
    flipped = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(flipped)


def reachable(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether a listener bound to `address` takes connections from outside the sandbox."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return not address.is_loopback


def listening_ports(tables: Iterable[str]) -> list[int]:
    """Sorted, without repeats: the ports of LISTEN sockets on a reachable address, in the tables' text."""
    ports = set()
    for text in tables:
        for line in text.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 4 or fields[3].upper() != LISTEN:
                continue
            host, _, port = fields[1].partition(":")
            address = _address(host)
            if address is None or not reachable(address):
                continue
            try:
                ports.add(int(port, 16))
            except ValueError:
                continue
    return sorted(ports)


def read_tables(paths: Iterable[str] = TABLES) -> list[str]:
    """The text of this network namespace's TCP tables (the host reads its own with it too: sandbox/tcp_table.py)."""
    texts = []
    for path in paths:
        try:
            with open(path) as f:
                texts.append(f.read())
        except OSError:
            pass
    return texts


def read() -> list[int]:
    return listening_ports(read_tables())
