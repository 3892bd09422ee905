"""The two ends of a proxied connection as streams, and the byte pump between them.

A `Side` is one end (the sandbox's, or the upstream's) as asyncio streams, plain or TLS. Half-closes pass through
when both ends are plain TCP; a TLS end cannot half-close (asyncio closes a TLS transport on the peer's EOF), so
there the first direction to end ends the connection. Failures reset: `Side.reset` closes with SO_LINGER 0, so the
peer sees a RST, as it would from a firewall, and no half-open connection is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

CHUNK = 65536
CLOSE_WAIT_S = 5.0  # how long a TLS close may take to say close_notify before the socket is dropped


@dataclass
class Side:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    tls: bool = False

    def reset(self) -> None:
        try:
            sock = self.writer.get_extra_info("socket")
        except AttributeError:  # a TLS transport closed already has no protocol left to ask
            sock = None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()

    async def close(self) -> None:
        """Flush and close (a TLS end also says close_notify); what does not finish in time is aborted."""
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), CLOSE_WAIT_S)
        except (OSError, TimeoutError):
            self.writer.transport.abort()


def reset_socket(sock: socket.socket) -> None:
    """Close a raw socket with a RST (SO_LINGER 0)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


async def pump(src: Side, dst: Side, count: Callable[[int], None]) -> None:
    """Copy src → dst until src's EOF; then half-close dst when it can (plain TCP)."""
    while data := await src.reader.read(CHUNK):
        count(len(data))
        dst.writer.write(data)
        await dst.writer.drain()
    if dst.writer.can_write_eof() and not dst.writer.transport.is_closing():
        dst.writer.write_eof()


async def splice(a: Side, b: Side, a_to_b: Callable[[int], None], b_to_a: Callable[[int], None]) -> None:
    """Both directions until both have ended (plain ends), or until either has (a TLS end), or either fails
    (raised, after the other direction is cancelled)."""
    up = asyncio.create_task(pump(a, b, a_to_b))
    down = asyncio.create_task(pump(b, a, b_to_a))
    await both(up, down, half_close=not (a.tls or b.tls))


async def both(first: asyncio.Task[None], second: asyncio.Task[None], *, half_close: bool) -> None:
    """Wait for two directions of one connection: raise the first failure (the other cancelled), and with
    `half_close` False end at the first direction that ends."""
    tasks = {first, second}
    try:
        while tasks:
            done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()
            if not half_close:
                break
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
