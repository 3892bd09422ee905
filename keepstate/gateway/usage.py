"""Token usage, normalised across providers.

Normal form: `input_tokens` counts all input, `cached_tokens` and `cache_write_tokens` are parts of it;
`output_tokens` counts all output, `reasoning_tokens` is part of it. OpenAI's input counts already include cached
tokens; Anthropic's `input_tokens` excludes both cache counts, so they are added here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from keepstate.gateway.sse import split_all

ENDPOINTS = ("chat", "responses", "embeddings", "messages")


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0

    def to_dict(self) -> dict[str, int]:
        # Not dataclasses.asdict: it deep-copies, and this runs on every call's hot path.
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "cached_tokens": self.cached_tokens, "cache_write_tokens": self.cache_write_tokens,
                "reasoning_tokens": self.reasoning_tokens}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Usage:
        return cls(**{f.name: int(d.get(f.name) or 0) for f in fields(cls)})


def _int(d: Any, *path: str) -> int:
    for p in path:
        if not isinstance(d, dict):
            return 0
        d = d.get(p)
    return d if isinstance(d, int) else 0


def from_openai_chat(u: dict[str, Any]) -> Usage:
    return Usage(
        input_tokens=_int(u, "prompt_tokens"),
        output_tokens=_int(u, "completion_tokens"),
        cached_tokens=_int(u, "prompt_tokens_details", "cached_tokens"),
        reasoning_tokens=_int(u, "completion_tokens_details", "reasoning_tokens"),
    )


def from_openai_responses(u: dict[str, Any]) -> Usage:
    return Usage(
        input_tokens=_int(u, "input_tokens"),
        output_tokens=_int(u, "output_tokens"),
        cached_tokens=_int(u, "input_tokens_details", "cached_tokens"),
        reasoning_tokens=_int(u, "output_tokens_details", "reasoning_tokens"),
    )


def from_openai_embeddings(u: dict[str, Any]) -> Usage:
    return Usage(input_tokens=_int(u, "prompt_tokens"))


def from_anthropic(u: dict[str, Any]) -> Usage:
    cache_read = _int(u, "cache_read_input_tokens")
    cache_write = _int(u, "cache_creation_input_tokens")
    return Usage(
        input_tokens=_int(u, "input_tokens") + cache_read + cache_write,
        output_tokens=_int(u, "output_tokens"),
        cached_tokens=cache_read,
        cache_write_tokens=cache_write,
    )


def from_response(endpoint: str, body: dict[str, Any]) -> Usage | None:
    """Usage of a non-streamed response body; None when the provider gave none."""
    u = body.get("usage")
    if not isinstance(u, dict):
        return None
    if endpoint == "chat":
        return from_openai_chat(u)
    if endpoint == "responses":
        return from_openai_responses(u)
    if endpoint == "embeddings":
        return from_openai_embeddings(u)
    return from_anthropic(u)


class StreamUsage:
    """Collects usage from a stream's events, one parsed JSON payload at a time."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._anthropic: dict[str, int] = {}
        self.usage: Usage | None = None

    def feed(self, payload: dict[str, Any]) -> None:
        if self.endpoint == "chat":
            if isinstance(payload.get("usage"), dict):
                self.usage = from_openai_chat(payload["usage"])
        elif self.endpoint == "responses":
            resp = payload.get("response")
            if isinstance(resp, dict) and isinstance(resp.get("usage"), dict):
                self.usage = from_openai_responses(resp["usage"])
        elif self.endpoint == "messages":
            # message_start carries input and cache counts; message_delta the cumulative output (and, in newer API
            # versions, the input counts again): later non-null values win.
            u = payload.get("usage")
            if payload.get("type") == "message_start":
                u = (payload.get("message") or {}).get("usage")
            if isinstance(u, dict):
                for k, v in u.items():
                    if isinstance(v, int):
                        self._anthropic[k] = v
                self.usage = from_anthropic(self._anthropic)


def event_payload(data: bytes) -> dict[str, Any] | None:
    if not data or data == b"[DONE]":
        return None
    try:
        payload = json.loads(data)
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


def from_stream(endpoint: str, body: bytes) -> Usage | None:
    acc = StreamUsage(endpoint)
    for ev in split_all(body):
        payload = event_payload(ev.data)
        if payload is not None:
            acc.feed(payload)
    return acc.usage


def from_stored(endpoint: str, stream: bool, body: bytes) -> Usage | None:
    """Usage parsed again from a stored response (what `ledger reconcile` compares the ledger with)."""
    if stream:
        return from_stream(endpoint, body)
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return from_response(endpoint, parsed) if isinstance(parsed, dict) else None
