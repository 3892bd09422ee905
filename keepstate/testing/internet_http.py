"""The fake internet's web sites: plain HTTP/1.1 over asyncio streams, with or without TLS.

Written by hand rather than with a framework because the tests need what a framework hides: the peer address the
site saw (did the connection come through NAT, the proxy, SOCKS?), the SNI the client sent, and the headers exactly
as they arrived (did the proxy set or substitute one?). Routes, at every site address:

- `GET /`: `site <name>` (the DNS name the address is for, or the address itself when it has none);
- `/echo` (any method): JSON `{"method", "path", "headers" (names lower-cased), "peer": "ip:port", "host",
  "sni" (null over plain HTTP), "scheme", "site", "body_bytes", "connection"}`, the last the number of the
  connection that carried the request (the site's first is 1; `Site.connections` counts them, both ports);
- `GET /bytes?n=N`: N bytes (zeros), with a Content-Length;
- `POST /sink`: reads the body (Content-Length or chunked) and answers JSON `{"received": N}`;
- how a connection can end, for the egress proxy's upstream pool: `GET /close-delimited` (a body without length,
  ended by closing), `GET /bye` (`Connection: close`, then closed), `GET /drop` (says keep-alive, then closes, as
  a server's idle timeout would), `GET /hang-up` (answered; the connection's next request is read and not
  answered: closed, as when a keep-alive timeout meets a request). Each answers `<route> <name> <connection>`.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

MAX_HEAD = 64 * 1024
MAX_BYTES = 1 << 36  # /bytes refuses more than 64 GiB: a typo, not a benchmark
CHUNK = 256 * 1024
_ZEROS = bytes(CHUNK)


@dataclass
class Site:
    """One listening address's identity; `extra` adds routes (path → JSON-able value made at request time)."""

    address: str
    name: str
    extra: dict[str, Callable[[], object]] = field(default_factory=dict)
    connections: int = 0  # accepted so far, on both ports


class BadRequest(Exception):
    pass


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, str, str, list[tuple[str, str]]] | None:
    line = await reader.readline()
    if not line:
        return None
    try:
        method, target, version = line.decode("latin-1").split()
    except ValueError:
        raise BadRequest("bad request line") from None
    headers: list[tuple[str, str]] = []
    size = len(line)
    while True:
        h = await reader.readline()
        size += len(h)
        if size > MAX_HEAD:
            raise BadRequest("head too large")
        if h in (b"\r\n", b"\n", b""):
            break
        name, sep, value = h.decode("latin-1").partition(":")
        if not sep:
            raise BadRequest("bad header line")
        headers.append((name.strip(), value.strip()))
    return method, target, version, headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> int:
    """Read (and discard) the request body; its length in bytes."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        total = 0
        while True:
            size_line = await reader.readline()
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise BadRequest("bad chunk size") from None
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return total
            left = size
            while left:
                got = await reader.read(min(left, CHUNK))
                if not got:
                    raise BadRequest("body cut short")
                left -= len(got)
            total += size
            await reader.readline()
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise BadRequest("bad content-length") from None
    left = length
    while left > 0:
        got = await reader.read(min(left, CHUNK))
        if not got:
            raise BadRequest("body cut short")
        left -= len(got)
    return length


def _head(status: str, length: int, ctype: str, keep: bool) -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {length}\r\n"
            f"Connection: {'keep-alive' if keep else 'close'}\r\n\r\n").encode()


ENDINGS = ("/close-delimited", "/bye", "/drop", "/hang-up")


async def handle(site: Site, scheme: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 number: int = 0) -> None:
    peer = writer.get_extra_info("peername")
    hang_up = False
    ssl_object = writer.get_extra_info("ssl_object")
    sni = getattr(ssl_object, "ks_sni", None) if ssl_object is not None else None
    try:
        while True:
            try:
                head = await _read_head(reader)
                if head is None:
                    return
                method, target, version, header_list = head
                headers: dict[str, str] = {}
                for k, v in header_list:
                    k = k.lower()
                    headers[k] = f"{headers[k]}, {v}" if k in headers else v
                body = await _read_body(reader, headers)
                if hang_up:
                    return
            except BadRequest as e:
                msg = json.dumps({"code": 400, "message": str(e)}).encode()
                writer.write(_head("400 Bad Request", len(msg), "application/json", False) + msg)
                await writer.drain()
                return
            conn = headers.get("connection", "").lower()
            keep = conn != "close" if version == "HTTP/1.1" else conn == "keep-alive"
            url = urlsplit(target)
            path = url.path or "/"
            status, ctype, payload, stream = "200 OK", "text/plain", b"", 0
            if path in ENDINGS and method == "GET":
                text = f"{path[1:]} {site.name} {number}".encode()
                if path == "/close-delimited":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n" + text)
                else:
                    writer.write(_head(status, len(text), ctype, path != "/bye") + text)
                await writer.drain()
                if path != "/hang-up":
                    return
                hang_up = True
                continue
            if path == "/" and method in ("GET", "HEAD"):
                payload = f"site {site.name}".encode()
            elif path == "/echo":
                ctype = "application/json"
                payload = json.dumps({
                    "method": method, "path": target, "headers": headers, "peer": f"{peer[0]}:{peer[1]}",
                    "host": headers.get("host"), "sni": sni, "scheme": scheme, "site": site.name,
                    "body_bytes": body, "connection": number}).encode()
            elif path == "/bytes" and method == "GET":
                try:
                    stream = int(parse_qs(url.query).get("n", ["0"])[0])
                    if not 0 <= stream <= MAX_BYTES:
                        raise ValueError
                except ValueError:
                    status, ctype = "400 Bad Request", "application/json"
                    payload = json.dumps({"code": 400, "message": "n must be an integer 0..2**36"}).encode()
                    stream = 0
                ctype = "application/octet-stream" if stream else ctype
            elif path == "/sink" and method in ("POST", "PUT"):
                ctype, payload = "application/json", json.dumps({"received": body}).encode()
            elif path in site.extra and method == "GET":
                ctype, payload = "application/json", json.dumps(site.extra[path]()).encode()
            else:
                status, ctype = "404 Not Found", "application/json"
                payload = json.dumps({"code": 404, "message": f"no route {method} {path}"}).encode()
            writer.write(_head(status, stream or len(payload), ctype, keep))
            if method != "HEAD":
                writer.write(payload)
                left = stream
                while left > 0:
                    n = min(left, CHUNK)
                    writer.write(_ZEROS[:n] if n < CHUNK else _ZEROS)
                    left -= n
                    await writer.drain()
            await writer.drain()
            if not keep:
                return
    except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, OSError):
        return
    finally:
        writer.close()


def tls_context(cert_pem: bytes, key_pem: bytes, directory: str) -> ssl.SSLContext:
    """A server context presenting `cert_pem`, noting each handshake's SNI on its SSLObject (`ks_sni`) for /echo."""
    import os
    import tempfile

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.set_alpn_protocols(["http/1.1"])
    fd, path = tempfile.mkstemp(dir=directory, suffix=".pem")
    try:
        os.write(fd, cert_pem + key_pem)
    finally:
        os.close(fd)
    ctx.load_cert_chain(path)
    os.unlink(path)

    def note_sni(obj: object, name: str | None, _ctx: ssl.SSLContext) -> None:
        obj.ks_sni = name  # type: ignore[attr-defined]

    ctx.sni_callback = note_sni
    return ctx


async def serve_site(site: Site, port: int, tls: ssl.SSLContext | None = None) -> asyncio.Server:
    scheme = "https" if tls is not None else "http"

    async def on_connect(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        site.connections += 1
        await handle(site, scheme, r, w, site.connections)

    return await asyncio.start_server(on_connect, site.address, port, ssl=tls, reuse_address=True, backlog=512)
