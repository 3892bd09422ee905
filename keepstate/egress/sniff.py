"""What a connection's first bytes say: a TLS ClientHello (and its SNI), an HTTP/1 request (and its Host), or
neither. Pure functions over bytes, so the proxy can peek without consuming and these can be tested alone.

`sniff(data)` returns None while the bytes seen so far could still become either (the proxy peeks again when more
arrive, up to its byte and time limits), else a `Sniffed`. Every malformed input is "opaque" or a ClientHello
without a name, never an exception: these bytes come from the sandbox.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Kind = Literal["tls", "http", "opaque"]
MAX_RECORD = 16384 + 2048  # TLSPlaintext.length limit (RFC 8446 5.1), with slack for older stacks
MAX_HELLO = 1 << 16
_LABEL = r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")
_REQUEST_LINE = re.compile(rb"^([A-Z]{1,20}) ([\x21-\x7e]+) HTTP/1\.[01]$")
_HTTP_PREFIX = b"HTTP/1."
MAX_LINE = 8192


@dataclass(frozen=True)
class Sniffed:
    kind: Kind
    host: str | None = None  # lower-case, no trailing dot, no port; None when the bytes name no host


OPAQUE = Sniffed("opaque")


def sniff(data: bytes) -> Sniffed | None:
    if not data:
        return None
    if data[0] == 0x16:
        return _tls(data)
    return _http(data)


def clean_host(raw: str) -> str | None:
    """A host name as a policy compares it (lower-case, no trailing dot), or None if it is not one."""
    h = raw.strip().lower().rstrip(".")
    return h if _HOSTNAME.match(h) else None


def host_header_name(value: str) -> str | None:
    """The host part of a Host header (`name[:port]`, `[v6]:port`), or None when it is not a host."""
    v = value.strip()
    if v.startswith("["):
        end = v.find("]")
        return v[1:end].lower() if end > 1 and re.fullmatch(r"[0-9a-fA-F:.]+", v[1:end]) else None
    name, _, port = v.partition(":")
    if port and not port.isdigit():
        return None
    if re.fullmatch(r"\d{1,3}(\.\d{1,3}){3}", name):
        return name
    return clean_host(name)


# --- TLS ---------------------------------------------------------------------------------------------------------

def _tls(data: bytes) -> Sniffed | None:
    """Reassemble the handshake layer from as many records as it spans (a ClientHello may be fragmented), then
    read the ClientHello."""
    hs = bytearray()
    pos = 0
    while True:
        if len(data) - pos < 5:
            return None
        ctype, major, length = data[pos], data[pos + 1], int.from_bytes(data[pos + 3:pos + 5], "big")
        if ctype != 0x16 or major != 3 or length == 0 or length > MAX_RECORD:
            return OPAQUE if pos == 0 else Sniffed("tls")
        hs += data[pos + 5:pos + 5 + length]
        need = _hello_length(hs)
        if need is not None and need < 0:
            return OPAQUE if pos == 0 else Sniffed("tls")
        if need is not None and len(hs) >= need:
            return Sniffed("tls", _sni(bytes(hs[4:need])))
        if len(data) - pos - 5 < length:
            return None
        pos += 5 + length


def final(data: bytes) -> Sniffed:
    """The answer once the proxy stops waiting (byte or time limit, or the client's EOF) on bytes `sniff` could
    not decide yet: a started ClientHello is TLS without a name, a started request line HTTP without a Host."""
    got = sniff(data)
    if got is not None:
        return got
    if data[:1] == b"\x16" and data[1:2] in (b"", b"\x03"):
        return Sniffed("tls")
    eol = data.find(b"\r\n")
    if eol > 0 and _REQUEST_LINE.match(data[:eol]):
        return Sniffed("http")
    return OPAQUE


def _hello_length(hs: bytearray) -> int | None:
    """The handshake message's full length (header included), None if not known yet, -1 if not a ClientHello."""
    if len(hs) < 4:
        return None
    if hs[0] != 0x01:
        return -1
    n = int.from_bytes(hs[1:4], "big")
    return 4 + n if n <= MAX_HELLO else -1


def _sni(body: bytes) -> str | None:
    """The host_name entry of the server_name extension (RFC 6066 3), or None (absent or malformed)."""
    r = _Reader(body)
    r.skip(2 + 32)  # legacy_version, random
    r.skip(r.num(1))  # legacy_session_id
    r.skip(r.num(2))  # cipher_suites
    r.skip(r.num(1))  # legacy_compression_methods
    if r.bad or r.left == 0:
        return None  # no extensions: a very old client
    ext = _Reader(r.take(r.num(2)))
    while not ext.bad and ext.left >= 4:
        etype, data = ext.num(2), ext.take(ext.num(2))
        if etype != 0:
            continue
        names = _Reader(data)
        entries = _Reader(names.take(names.num(2)))
        while not entries.bad and entries.left >= 3:
            ntype, name = entries.num(1), entries.take(entries.num(2))
            if ntype == 0 and not entries.bad:
                try:
                    return clean_host(name.decode("ascii"))
                except UnicodeDecodeError:
                    return None
        return None
    return None


class _Reader:
    """Bounds-checked reads: past the end it sets `bad` and returns zeros, so the parser has no IndexError paths."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos, self.bad = data, 0, False

    @property
    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int) -> bytes:
        if n > self.left:
            self.bad = True
            self.pos = len(self.data)
            return b""
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def num(self, n: int) -> int:
        b = self.take(n)
        return int.from_bytes(b, "big") if b else 0

    def skip(self, n: int) -> None:
        self.take(n)


# --- HTTP/1 ------------------------------------------------------------------------------------------------------

def _http(data: bytes) -> Sniffed | None:
    eol = data.find(b"\r\n")
    if eol < 0:
        return None if len(data) <= MAX_LINE and _line_prefix(data) else OPAQUE
    if not _REQUEST_LINE.match(data[:eol]):
        return OPAQUE
    end = data.find(b"\r\n\r\n", eol)
    if end < 0:
        return None
    host = None
    for line in data[eol + 2:end].split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"host":
            try:
                host = host_header_name(value.decode("ascii"))
            except UnicodeDecodeError:
                host = None
            break
    return Sniffed("http", host)


def _line_prefix(data: bytes) -> bool:
    """Whether `data` (no CRLF yet) can still grow into `METHOD SP target SP HTTP/1.x`."""
    m = re.match(rb"^[A-Z]{0,20}$", data)
    if m:
        return True
    m = re.match(rb"^[A-Z]{1,20} [\x21-\x7e]*$", data)
    if m:
        return True
    m = re.match(rb"^[A-Z]{1,20} [\x21-\x7e]+ ([\x21-\x7e]*)\r?$", data)
    if not m:
        return False
    tail = m.group(1)
    return _HTTP_PREFIX.startswith(tail[:7]) and (len(tail) <= 7 or (len(tail) == 8 and tail[7:] in (b"0", b"1")))
