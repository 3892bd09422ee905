"""A viewer's side of a desktop's stream, for tests: the WebSocket noVNC's page opens (`/websockify` of the 6080 port
URL), and RFB 3.8 over it (RFC 6143) as far as the server's first frame-buffer description: the greeting, the
security types, VNC authentication (DES of the challenge with the password, as x11vnc checks it) and ServerInit."""

from __future__ import annotations

import asyncio
import ssl
import struct
from dataclasses import dataclass, field

import aiohttp
from cryptography.hazmat.decrepit.ciphers.algorithms import TripleDES
from cryptography.hazmat.primitives.ciphers import Cipher, modes

NONE, VNC_AUTH = 1, 2  # RFB security types


@dataclass
class Handshake:
    greeting: bytes = b""
    security_types: list[int] = field(default_factory=list)
    authenticated: bool = False
    width: int = 0
    height: int = 0
    name: str = ""


def vnc_response(challenge: bytes, password: str) -> bytes:
    """VNC authentication's answer: the challenge DES-encrypted with the password (8 bytes, NUL-padded), each key
    byte's bits reversed (RFB's quirk). Single DES as three-key DES with one key thrice."""
    key = bytes(int(f"{b:08b}"[::-1], 2) for b in password.encode()[:8].ljust(8, b"\0"))
    encryptor = Cipher(TripleDES(key * 3), modes.ECB()).encryptor()
    return encryptor.update(challenge) + encryptor.finalize()


class _Stream:
    """Bytes from WebSocket messages, which websockify cuts wherever it likes."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws, self.buf = ws, b""

    async def read(self, n: int) -> bytes:
        while len(self.buf) < n:
            msg = await self.ws.receive(timeout=30)
            if msg.type != aiohttp.WSMsgType.BINARY:
                raise ConnectionError(f"the stream ended: {msg.type.name} {msg.data!r}")
            self.buf += msg.data
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


async def _handshake(url: str, headers: dict[str, str], context: ssl.SSLContext | None,
                     password: str | None) -> Handshake:
    out = Handshake()
    async with aiohttp.ClientSession() as session, session.ws_connect(
            url, protocols=("binary",), headers=headers, ssl=context if context else False,
            timeout=aiohttp.ClientWSTimeout(ws_close=10)) as ws:
        stream = _Stream(ws)
        out.greeting = await stream.read(12)
        if not out.greeting.startswith(b"RFB 003."):
            return out
        await ws.send_bytes(b"RFB 003.008\n")
        count = (await stream.read(1))[0]
        if count == 0:
            (length,) = struct.unpack(">I", await stream.read(4))
            raise ConnectionError(f"refused: {(await stream.read(length)).decode(errors='replace')}")
        out.security_types = list(await stream.read(count))
        kind = VNC_AUTH if password is not None else NONE
        if kind not in out.security_types:
            return out
        await ws.send_bytes(bytes([kind]))
        if kind == VNC_AUTH:
            await ws.send_bytes(vnc_response(await stream.read(16), password or ""))
        (result,) = struct.unpack(">I", await stream.read(4))
        out.authenticated = result == 0
        if not out.authenticated:
            return out
        await ws.send_bytes(b"\x01")  # ClientInit: share the desktop with other viewers
        out.width, out.height = struct.unpack(">HH", await stream.read(4))
        await stream.read(16)  # the pixel format
        (length,) = struct.unpack(">I", await stream.read(4))
        out.name = (await stream.read(length)).decode(errors="replace")
        return out


def handshake(url: str, headers: dict[str, str] | None = None, context: ssl.SSLContext | None = None,
              password: str | None = None) -> Handshake:
    """RFB over the WebSocket at `url` (ws:// or wss://) as far as ServerInit; `password`: VNC authentication, else
    the security type None."""
    return asyncio.run(_handshake(url, headers or {}, context, password))
