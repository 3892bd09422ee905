"""HTTP/1.1 heads and bodies for a host with header rules: requests parsed and rewritten, responses framed.

Requests are parsed strictly (one Content-Length, chunked last, never both) so the proxy and the upstream agree
where each request ends: a header set by a rule must land on a request head. Responses are parsed for their framing
only (RFC 9112 section 6.3: no body after HEAD, 1xx, 204 and 304; chunked; Content-Length; else until close), so
the relay (`relay.py`) knows where each ends and whether the upstream connection may carry another; their heads
and bodies are forwarded as they came, except that the proxy says `Connection: close` to a sandbox whose connection
it is about to end.

Headers a rule may not set: the framing ones (Content-Length, Transfer-Encoding), which would let the upstream
read the body differently from how it is forwarded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from keepstate.egress.pipe import CHUNK, Side
from keepstate.egress.policy import SECRET_REF, HeaderRule
from keepstate.egress.sniff import host_header_name

log = logging.getLogger(__name__)

MAX_HEAD = 65536
FRAMING = {"content-length", "transfer-encoding"}
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_REQUEST_LINE = re.compile(r"^([!#$%&'*+.^_`|~0-9A-Za-z-]+) ([\x21-\x7e]+) (HTTP/1\.[01])$")
_STATUS_LINE = re.compile(r"^(HTTP/1\.[01]) ([1-9][0-9]{2})(?: ([\t\x20-\x7e\x80-\xff]*))?$")
REASONS = {400: "Bad Request", 403: "Forbidden", 431: "Request Header Fields Too Large", 502: "Bad Gateway"}
CHUNKED, UNTIL_CLOSE, TUNNEL = -1, -2, -3  # a response body's framing, beside a length >= 0


class Answer(Exception):
    """Answer the sandbox with this error and close: raised before any byte of the request went upstream, or
    before any byte of its final response came back to the sandbox (an upstream that failed it: 502)."""

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

    @property
    def closes(self) -> bool:
        """The client ends its connection after this request's response (RFC 9112 section 9.3)."""
        tokens = connection_tokens(self.headers)
        return "close" in tokens or (self.version == "HTTP/1.0" and "keep-alive" not in tokens)

    def keep_upstream(self) -> None:
        """Drop the client's `close` from the head sent upstream: Connection is hop-by-hop, and the proxy's
        connection to the upstream may outlive the client's (the pool)."""
        if self.version == "HTTP/1.1" and "close" in connection_tokens(self.headers):
            _drop_tokens(self.headers, {"close"})

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


@dataclass
class Response:
    version: str
    status: int
    headers: list[tuple[str, str]]
    raw: bytes  # the head as it came (forwarded so unless the proxy must say close)

    def framing(self, method: str) -> int:
        """How the body of this response to `method` ends: a length, CHUNKED, UNTIL_CLOSE, or TUNNEL (a 101, or a
        CONNECT's 2xx: the connection is no longer HTTP). BadResponse for a Content-Length that is not one number
        (RFC 9112 section 6.3 makes a proxy refuse it)."""
        if self.status == 101 or (method == "CONNECT" and 200 <= self.status < 300):
            return TUNNEL
        if method == "HEAD" or self.status < 200 or self.status in (204, 304):
            return 0
        te = [t.strip().lower() for k, v in self.headers if k.lower() == "transfer-encoding" for t in v.split(",")
              if t.strip()]
        if te:
            return CHUNKED if te[-1] == "chunked" else UNTIL_CLOSE
        cl = {p.strip() for k, v in self.headers if k.lower() == "content-length" for p in v.split(",")}
        if not cl:
            return UNTIL_CLOSE
        if len(cl) > 1 or not next(iter(cl)).isdigit():
            raise BadResponse("its Content-Length is not one non-negative integer")
        return int(next(iter(cl)))

    @property
    def keeps_alive(self) -> bool:
        """The upstream may take another request on this connection after this response (an HTTP/1.1 response
        without `Connection: close` and without both framings, which RFC 9112 section 6.1 has a proxy close)."""
        names = {k.lower() for k, _ in self.headers}
        return (self.version == "HTTP/1.1" and "close" not in connection_tokens(self.headers)
                and not {"transfer-encoding", "content-length"} <= names)

    @property
    def idle_s(self) -> float | None:
        """The `Keep-Alive: timeout=N` the upstream announced, if any: how long it keeps an idle connection."""
        for k, v in self.headers:
            if k.lower() == "keep-alive":
                for part in v.split(","):
                    name, _, value = part.strip().partition("=")
                    if name.strip().lower() == "timeout" and value.strip().isdigit():
                        return float(value.strip())
        return None

    def closing(self) -> bytes:
        """The head to send a sandbox whose connection ends after this response: its own when it says close."""
        if "close" in connection_tokens(self.headers):
            return self.raw
        headers = [(k, v) for k, v in self.headers if k.lower() != "keep-alive"]
        _drop_tokens(headers, {"close", "keep-alive"})
        headers.append(("Connection", "close"))
        status_line = self.raw.split(b"\r\n", 1)[0].decode("latin-1")
        lines = [status_line] + [f"{k}: {v}" for k, v in headers]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class BadResponse(Exception):
    """The upstream's response head cannot be relayed (the sandbox gets a 502 naming why)."""


def connection_tokens(headers: list[tuple[str, str]]) -> set[str]:
    return {t.strip().lower() for k, v in headers if k.lower() == "connection" for t in v.split(",") if t.strip()}


def _drop_tokens(headers: list[tuple[str, str]], drop: set[str]) -> None:
    """Remove `drop` from the Connection headers in place (a header left empty goes)."""
    out: list[tuple[str, str]] = []
    for k, v in headers:
        if k.lower() == "connection":
            v = ", ".join(t.strip() for t in v.split(",") if t.strip() and t.strip().lower() not in drop)
            if not v:
                continue
        out.append((k, v))
    headers[:] = out


def parse_response_head(head: bytes) -> Response:
    """A response head (through its blank line) → Response; BadResponse for anything malformed."""
    text = head.decode("latin-1")
    lines = text[:-4].split("\r\n") if text.endswith("\r\n\r\n") else text.split("\r\n")
    m = _STATUS_LINE.match(lines[0])
    if not m:
        raise BadResponse("its status line is malformed")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.match(name) or any(c in value for c in "\r\n\0"):
            raise BadResponse("a header line is malformed")
        headers.append((name, value.strip(" \t")))
    return Response(m.group(1), int(m.group(2)), headers, head)


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
        await copy_chunked(src, dst, count)
    else:
        await copy_exact(src, dst, length, count)


async def copy_exact(src: Side, dst: Side, n: int, count: Callable[[int], None]) -> None:
    """`n` bytes src → dst; `count` is told each piece read."""
    while n > 0:
        data = await src.reader.read(min(n, CHUNK))
        if not data:
            raise ConnectionError("the peer closed in the middle of a body")
        n -= len(data)
        count(len(data))
        dst.writer.write(data)
        await dst.writer.drain()


async def copy_chunked(src: Side, dst: Side, count: Callable[[int], None]) -> None:
    """A chunked body src → dst, through its last chunk and trailers."""
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
        await copy_exact(src, dst, size, count)
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
