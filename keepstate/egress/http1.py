"""HTTP/1.1 requests from the sandbox to a host with header rules: parsed one by one, headers set, forwarded.

Only the request direction is parsed (keep-alive, Content-Length and chunked bodies, an Upgrade or CONNECT that
turns the rest into a splice); responses are spliced as bytes, since one client connection maps to one upstream
connection and no pipelining is needed. Framing is checked strictly (one Content-Length, chunked last, never both)
so the proxy and the upstream agree where each request ends: a header set by a rule must land on a request head.

Headers a rule may not set: the framing ones (Content-Length, Transfer-Encoding), which would let the upstream
read the body differently from how it is forwarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from keepstate.egress.pipe import CHUNK, Side, both, pump
from keepstate.egress.policy import SECRET_REF, HeaderRule
from keepstate.egress.sniff import host_header_name

log = logging.getLogger(__name__)

MAX_HEAD = 65536
LINGER_S = 2.0
LINGER_BYTES = 1 << 20
FRAMING = {"content-length", "transfer-encoding"}
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_REQUEST_LINE = re.compile(r"^([!#$%&'*+.^_`|~0-9A-Za-z-]+) ([\x21-\x7e]+) (HTTP/1\.[01])$")
REASONS = {400: "Bad Request", 403: "Forbidden", 431: "Request Header Fields Too Large", 502: "Bad Gateway"}


class Answer(Exception):
    """Answer the sandbox with this error and close: raised before any byte of the request went upstream."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    def response(self) -> bytes:
        body = json.dumps({"code": self.status, "message": self.message}).encode()
        head = (f"HTTP/1.1 {self.status} {REASONS.get(self.status, 'Error')}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
        return head.encode() + body


@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]] = field(default_factory=list)

    def values(self, name: str) -> list[str]:
        n = name.lower()
        return [v for k, v in self.headers if k.lower() == n]

    def get(self, name: str) -> str | None:
        vs = self.values(name)
        return vs[0] if vs else None

    def set(self, name: str, value: str) -> None:
        """Replace every header of that name (whatever its case) with this one."""
        n = name.lower()
        self.headers = [(k, v) for k, v in self.headers if k.lower() != n] + [(name, value)]

    @property
    def host(self) -> str | None:
        h = self.get("host")
        return host_header_name(h) if h is not None else None

    @property
    def upgrade(self) -> bool:
        """After this request the connection is no longer HTTP (a WebSocket, a CONNECT tunnel)."""
        tokens = {t.strip().lower() for v in self.values("connection") for t in v.split(",")}
        return self.method == "CONNECT" or ("upgrade" in tokens and self.get("upgrade") is not None)

    def framing(self) -> int | None:
        """The body's length, or None for chunked. Ambiguous framing is refused (request smuggling)."""
        te = [t.strip().lower() for v in self.values("transfer-encoding") for t in v.split(",") if t.strip()]
        cl = {v.strip() for v in self.values("content-length")}
        if te:
            if cl:
                raise Answer(400, "a request may not carry both Transfer-Encoding and Content-Length")
            if te[-1] != "chunked" or self.version == "HTTP/1.0":
                raise Answer(400, "a request's Transfer-Encoding must end with chunked")
            return None
        if not cl:
            return 0
        if len(cl) > 1 or not next(iter(cl)).isdigit():
            raise Answer(400, "a request's Content-Length must be one non-negative integer")
        return int(next(iter(cl)))

    def encode(self) -> bytes:
        lines = [f"{self.method} {self.target} {self.version}"] + [f"{k}: {v}" for k, v in self.headers]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def parse_head(head: bytes) -> Request:
    """A request head (through its blank line) → Request; Answer(400) for anything malformed."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise Answer(400, "the request head is not text") from None
    lines = text[:-4].split("\r\n") if text.endswith("\r\n\r\n") else text.split("\r\n")
    m = _REQUEST_LINE.match(lines[0])
    if not m:
        raise Answer(400, "malformed request line")
    req = Request(m.group(1), m.group(2), m.group(3))
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.match(name) or any(c in value for c in "\r\n\0"):
            raise Answer(400, "malformed header line (obsolete line folding is not accepted)")
        req.headers.append((name, value.strip(" \t")))
    return req


def set_rule_headers(req: Request, host: str, rules: tuple[HeaderRule, ...],
                     secret_value: Callable[[str], str | None]) -> list[str]:
    """Set each rule's headers on `req`, `${e2b.secrets.NAME}` replaced by the secret's value; returns the header
    names set (for the log: never a value). Answer(502) if a secret is gone or unusable in a header; the message
    names the secret, never a value."""
    out = [(name, _fill(template, host, name, secret_value))
           for rule in rules for name, template in rule.headers if name.lower() not in FRAMING]
    for name, filled in out:
        req.set(name, filled)
    return [n for n, _ in out]


def _fill(template: str, host: str, header: str, secret_value: Callable[[str], str | None]) -> str:
    def value(m: re.Match[str]) -> str:
        secret = m.group(1).lower()
        v = secret_value(secret)
        if v is None:
            raise Answer(502, f"the secret {secret!r} that the egress rule for {host} sets in {header} "
                              f"does not exist")
        if any(c in v for c in "\r\n\0"):
            raise Answer(502, f"the secret {secret!r} that the egress rule for {host} sets in {header} "
                              f"holds a line break or NUL, which a header cannot carry")
        return v.encode().decode("latin-1")  # heads are kept as Latin-1 text: this sends the value's UTF-8 bytes

    return SECRET_REF.sub(value, template)


async def read_head(reader: asyncio.StreamReader) -> bytes | None:
    """The next request head, None on EOF between requests; Answer for one too large."""
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if e.partial.strip():
            raise ConnectionError("the client closed in the middle of a request head") from None
        return None
    except asyncio.LimitOverrunError:
        raise Answer(431, f"a request head may be at most {MAX_HEAD} bytes") from None


async def copy_body(req: Request, src: Side, dst: Side, count: Callable[[int], None]) -> None:
    length = req.framing()
    if length is None:
        await _copy_chunked(src, dst, count)
    else:
        await _copy_exact(src, dst, length, count)


async def _copy_exact(src: Side, dst: Side, n: int, count: Callable[[int], None]) -> None:
    while n > 0:
        data = await src.reader.read(min(n, CHUNK))
        if not data:
            raise ConnectionError("the client closed in the middle of a request body")
        n -= len(data)
        count(len(data))
        dst.writer.write(data)
        await dst.writer.drain()


async def _copy_chunked(src: Side, dst: Side, count: Callable[[int], None]) -> None:
    while True:
        line = await _line(src)
        size_text = line.split(b";", 1)[0].strip()
        if not size_text or not re.fullmatch(rb"[0-9a-fA-F]{1,16}", size_text):
            raise ConnectionError("malformed chunk size")
        count(len(line))
        dst.writer.write(line)
        size = int(size_text, 16)
        if size == 0:
            while True:  # trailers, then the blank line
                t = await _line(src)
                count(len(t))
                dst.writer.write(t)
                if t == b"\r\n":
                    await dst.writer.drain()
                    return
        await _copy_exact(src, dst, size, count)
        crlf = await src.reader.readexactly(2)
        if crlf != b"\r\n":
            raise ConnectionError("a chunk does not end with CRLF")
        count(2)
        dst.writer.write(crlf)


async def _line(src: Side) -> bytes:
    try:
        return await src.reader.readuntil(b"\r\n")
    except asyncio.LimitOverrunError:
        raise ConnectionError("a chunk line is too long") from None


Rewrite = Callable[[Request], Awaitable[None]]  # sets headers on one request; raises Answer to refuse it


async def relay(client: Side, upstream: Side, rewrite: Rewrite, up: Callable[[int], None],
                down: Callable[[int], None]) -> None:
    """Requests client → upstream, each rewritten; responses upstream → client as bytes."""
    responses = asyncio.create_task(pump(upstream, client, down))
    requests = asyncio.create_task(_requests(client, upstream, rewrite, up))
    try:
        await both(requests, responses, half_close=not (client.tls or upstream.tls))
    except Answer as a:
        log.info("egress: answered %d: %s", a.status, a.message)  # names a host, header or secret, never a value
        answer = a.response()
        down(len(answer))
        client.writer.write(answer)
        await client.writer.drain()
        await _linger(client)


async def _linger(client: Side) -> None:
    """After an answer the proxy made: half-close and read what the client still sends for a moment, so closing
    with unread bytes does not reset the connection before the client has read the answer."""
    if client.writer.can_write_eof():
        client.writer.write_eof()
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(LINGER_S):
            seen = 0
            while seen < LINGER_BYTES and (data := await client.reader.read(CHUNK)):
                seen += len(data)


async def _requests(client: Side, upstream: Side, rewrite: Rewrite, up: Callable[[int], None]) -> None:
    while True:
        head = await read_head(client.reader)
        if head is None:
            break
        up(len(head))
        head = head.lstrip(b"\r\n")  # empty lines before a request line are ignored (RFC 9112 2.2)
        if not head:
            continue
        req = parse_head(head)
        req.framing()  # refuse ambiguous framing before anything goes upstream
        await rewrite(req)
        upstream.writer.write(req.encode())
        await copy_body(req, client, upstream, up)
        if req.upgrade:
            await pump(client, upstream, up)
            return
    if upstream.writer.can_write_eof() and not upstream.writer.transport.is_closing():
        upstream.writer.write_eof()
