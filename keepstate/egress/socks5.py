"""A SOCKS5 client: CONNECT through a policy's `egressProxy` (RFC 1928), with username/password (RFC 1929).

The proxy always asks for the original destination's address, never a name: the sandbox's own resolution is what
the policy judged, and a name would let the upstream resolve it to something else. Any failure raises
`Socks5Error`; the caller resets the sandbox's connection (fail closed: never a direct dial instead).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

from keepstate.egress.policy import EgressProxy

REPLIES = {1: "general failure", 2: "connection not allowed by ruleset", 3: "network unreachable",
           4: "host unreachable", 5: "connection refused", 6: "TTL expired", 7: "command not supported",
           8: "address type not supported"}


class Socks5Error(Exception):
    """The upstream SOCKS5 proxy refused or broke the handshake (the message names no credential)."""


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise Socks5Error("the SOCKS5 proxy closed the connection during the handshake")
        buf += chunk
    return bytes(buf)


async def handshake(sock: socket.socket, proxy: EgressProxy, ip: str, port: int) -> None:
    """On `sock`, already connected to the SOCKS5 proxy, ask it to CONNECT to ip:port; return once it has."""
    loop = asyncio.get_running_loop()
    methods = b"\x00\x02" if proxy.username is not None else b"\x00"
    await loop.sock_sendall(sock, b"\x05" + bytes([len(methods)]) + methods)
    ver, method = await _recv_exactly(loop, sock, 2)
    if ver != 5:
        raise Socks5Error("the upstream is not a SOCKS5 proxy")
    if method == 0x02 and proxy.username is not None:
        user, pw = proxy.username.encode(), (proxy.password or "").encode()
        await loop.sock_sendall(sock, b"\x01" + bytes([len(user)]) + user + bytes([len(pw)]) + pw)
        _, status = await _recv_exactly(loop, sock, 2)
        if status != 0:
            raise Socks5Error("the SOCKS5 proxy rejected the username and password")
    elif method != 0x00:
        raise Socks5Error("the SOCKS5 proxy offers no authentication method we can use")
    addr = ipaddress.ip_address(ip)
    atyp = b"\x01" if addr.version == 4 else b"\x04"
    await loop.sock_sendall(sock, b"\x05\x01\x00" + atyp + addr.packed + port.to_bytes(2, "big"))
    ver, rep, _, atyp_r = await _recv_exactly(loop, sock, 4)
    if ver != 5:
        raise Socks5Error("the SOCKS5 proxy sent a malformed reply")
    if rep != 0:
        raise Socks5Error(f"the SOCKS5 proxy could not connect: {REPLIES.get(rep, f'reply {rep}')}")
    if atyp_r == 1:
        await _recv_exactly(loop, sock, 4 + 2)
    elif atyp_r == 4:
        await _recv_exactly(loop, sock, 16 + 2)
    elif atyp_r == 3:
        (n,) = await _recv_exactly(loop, sock, 1)
        await _recv_exactly(loop, sock, n + 2)
    else:
        raise Socks5Error("the SOCKS5 proxy sent a malformed reply")
