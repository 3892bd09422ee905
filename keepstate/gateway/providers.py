"""How one request is sent to one provider (pure): URL, headers, and the body the gateway sends upstream."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from keepstate.gateway.config import ProviderConfig

# endpoint -> (path relative to an OpenAI base URL ending in /v1, or to an Anthropic base URL)
PATHS = {
    "chat": "/chat/completions",
    "responses": "/responses",
    "embeddings": "/embeddings",
    "messages": "/v1/messages",
}
FORWARDED_HEADERS = ("anthropic-version", "anthropic-beta", "openai-beta")
DEFAULT_ANTHROPIC_VERSION = "2023-06-01"


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    url: str
    headers: dict[str, str]
    body: bytes
    hide_usage_chunk: bool  # the gateway asked for stream usage the client did not ask for


def flavour(endpoint: str) -> str:
    return "anthropic" if endpoint == "messages" else "openai"


def build(
    provider: ProviderConfig, endpoint: str, body: dict[str, Any], raw: bytes, client_headers: dict[str, str],
    stream: bool, cap_field: str | None, cap: int,
) -> UpstreamRequest:
    hide = hides_usage(endpoint, body, stream)
    changed = dict(body) if (cap_field or hide) else None
    if changed is not None:
        if cap_field:
            changed[cap_field] = cap
        if hide:
            changed["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    headers = {"content-type": "application/json"}
    for h in FORWARDED_HEADERS:
        if h in client_headers:
            headers[h] = client_headers[h]
    if provider.kind == "anthropic":
        headers["x-api-key"] = provider.api_key
        headers.setdefault("anthropic-version", DEFAULT_ANTHROPIC_VERSION)
    else:
        headers["authorization"] = f"Bearer {provider.api_key}"
    out = raw if changed is None else json.dumps(changed).encode()
    return UpstreamRequest(provider.base_url + PATHS[endpoint], headers, out, hide)


def hides_usage(endpoint: str, body: dict[str, Any], stream: bool) -> bool:
    """Whether the gateway must ask for stream usage that the client did not ask for (and hide it again)."""
    if not (stream and endpoint == "chat"):
        return False
    opts = body.get("stream_options")
    return not (isinstance(opts, dict) and opts.get("include_usage"))


def request_id(provider_kind: str, headers: Any) -> str | None:
    value = headers.get("request-id" if provider_kind == "anthropic" else "x-request-id")
    return None if value is None else str(value)


def is_terminal(endpoint: str, event: str | None, data: bytes) -> bool:
    """The event that tells a client the stream is complete; held back until the call is stored."""
    if endpoint == "chat":
        return data == b"[DONE]"
    if endpoint == "messages":
        return event == "message_stop" or b'"type":"message_stop"' in data or b'"type": "message_stop"' in data
    if endpoint == "responses":
        return event in ("response.completed", "response.incomplete", "response.failed")
    return False


def hidden(hide_usage_chunk: bool, payload: dict[str, Any] | None) -> bool:
    """The usage-only chunk of an OpenAI chat stream, when the client did not ask for it."""
    return (
        hide_usage_chunk and payload is not None and payload.get("choices") == [] and payload.get("usage") is not None
    )
