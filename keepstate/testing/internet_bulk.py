"""The fake internet's bulk server (203.0.113.50:9000) for throughput benchmarks, in a process of its own.

Threads and blocking `sendall` of one large buffer rather than asyncio: each call hands the kernel megabytes, so
the sender costs almost no CPU and the figure measured is the datapath's, not this server's. It speaks just enough
HTTP/1.1 for curl and urllib: `GET /bytes?n=N` sends N zero bytes; `POST /sink` reads the body (Content-Length,
or until the client shuts its side) and answers `{"received": N}`. One request per connection.
"""

from __future__ import annotations

import json
import socket
import socketserver
from urllib.parse import parse_qs, urlsplit

BUFFER = 4 << 20
_ZEROS = memoryview(bytes(BUFFER))


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = b""
        while b"\r\n\r\n" not in head:
            got = sock.recv(65536)
            if not got or len(head) > 65536:
                return
            head += got
        raw, _, rest = head.partition(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        try:
            method, target, _ = lines[0].split()
        except ValueError:
            return
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
        url = urlsplit(target)
        if method == "GET" and url.path == "/bytes":
            try:
                n = int(parse_qs(url.query).get("n", ["0"])[0])
            except ValueError:
                n = -1
            if n < 0:
                self._reply(400, b'{"code": 400, "message": "n must be a non-negative integer"}')
                return
            sock.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {n}\r\n"
                         "Connection: close\r\n\r\n".encode())
            while n > 0:
                k = min(n, BUFFER)
                sock.sendall(_ZEROS[:k])
                n -= k
        elif method in ("POST", "PUT") and url.path == "/sink":
            length = int(headers["content-length"]) if headers.get("content-length", "").isdigit() else None
            received = len(rest)
            buf = bytearray(BUFFER)
            while length is None or received < length:
                n = sock.recv_into(buf)
                if not n:
                    break
                received += n
            self._reply(200, json.dumps({"received": received}).encode())
        else:
            self._reply(404, json.dumps({"code": 404, "message": f"no route {method} {url.path}"}).encode())

    def _reply(self, status: int, body: bytes) -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}[status]
        self.request.sendall(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)


class BulkServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 128


def bulk_server(address: str, port: int) -> BulkServer:
    """Bound and listening on return; `serve_forever()` answers."""
    return BulkServer((address, port), _Handler)
