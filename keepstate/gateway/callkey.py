"""Call keys: the identity of one logical model call (see docs/design/gateway.md, "Call keys")."""

from __future__ import annotations

import json
from typing import Any

import blake3


def canonical_body(body: Any) -> bytes:
    """The body as canonical JSON, so that key order and spacing never make two calls differ."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def body_hash(endpoint: str, body: Any) -> str:
    h = blake3.blake3(endpoint.encode() + b"\0")
    h.update(canonical_body(body))
    return h.hexdigest()[:32]


def _key(*parts: str) -> str:
    h = blake3.blake3()
    for part in parts:
        h.update(part.encode() + b"\0")
    return "ck_" + h.hexdigest()[:32]


def idempotency_call_key(session_id: str, idempotency_key: str) -> str:
    return _key("idem", session_id, idempotency_key)


def position_call_key(session_id: str, checkpoint_id: str | None, ordinal: int, body_digest: str) -> str:
    return _key("pos", session_id, checkpoint_id or "", str(ordinal), body_digest)


def retry_count(header: str | None) -> int:
    """The SDK's `x-stainless-retry-count`; anything unparsable counts as a first attempt."""
    try:
        return max(0, int(header or "0"))
    except ValueError:
        return 0
