"""Small ASGI helpers for the agent's plain-HTTP routes (no framework: fewer imports, faster start)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class HTTPError(Exception):
    """Rendered as `{"code": status, "message": message}` — the one JSON error shape envd uses."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def header(scope: Scope, name: str) -> str | None:
    key = name.lower().encode()
    for k, v in scope.get("headers", ()):
        if k == key:
            return str(v.decode("latin-1"))
    return None


def headers_with_prefix(scope: Scope, prefix: str) -> dict[str, str]:
    """Headers starting with `prefix` (case-insensitive), keyed by the lower-cased rest of the name."""
    p = prefix.lower().encode()
    out: dict[str, str] = {}
    for k, v in scope.get("headers", ()):
        if k.lower().startswith(p):
            out[k[len(p) :].decode("latin-1").lower()] = v.decode("latin-1")
    return out


def query(scope: Scope) -> dict[str, str]:
    raw = scope.get("query_string", b"").decode("latin-1")
    try:
        parsed = parse_qs(raw, keep_blank_values=True, encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        raise HTTPError(400, "query string is not valid UTF-8") from None
    return {k: v[0] for k, v in parsed.items()}


async def send_json(send: Send, status: int, body: Any, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": data})


async def send_error(send: Send, status: int, message: str) -> None:
    await send_json(send, status, {"code": status, "message": message})


async def send_empty(send: Send, status: int) -> None:
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def iter_body(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise HTTPError(400, "client disconnected before the body was complete")
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return


async def read_body(receive: Receive, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for chunk in iter_body(receive):
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"body larger than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)
