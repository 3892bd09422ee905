"""Worst-case size of a call, for budget reservations made before it goes upstream (pure).

Input tokens are bounded by the body's byte length (a byte-level tokenizer never yields more tokens than bytes)
plus a fixed allowance per image part; output tokens by the request's own limit, or by a cap the gateway sets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

IMAGE_TOKENS = 4096
_IMAGE_PART_TYPES = {"image_url", "input_image", "image", "document", "input_file"}

# The field each endpoint reads as its output-token limit, in order of preference.
OUTPUT_LIMIT_FIELDS: dict[str, tuple[str, ...]] = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "responses": ("max_output_tokens",),
    "messages": ("max_tokens",),
    "embeddings": (),
}


@dataclass(frozen=True, slots=True)
class WorstCase:
    input_tokens: int
    output_tokens: int
    cap_field: str | None  # set when the gateway must add this output limit to the upstream request


def _count_images(node: Any) -> int:
    if isinstance(node, dict):
        own = 1 if node.get("type") in _IMAGE_PART_TYPES else 0
        return own + sum(_count_images(v) for v in node.values())
    if isinstance(node, list):
        return sum(_count_images(v) for v in node)
    return 0


def worst_case(endpoint: str, body: dict[str, Any], body_bytes: int, default_max_output: int) -> WorstCase:
    input_tokens = body_bytes + IMAGE_TOKENS * _count_images(body.get("messages") or body.get("input"))
    fields = OUTPUT_LIMIT_FIELDS[endpoint]
    if not fields:
        return WorstCase(input_tokens, 0, None)
    limit: int | None = next((body[f] for f in fields if isinstance(body.get(f), int) and body[f] > 0), None)
    cap_field = None
    if limit is None:
        limit, cap_field = default_max_output, fields[0]
    n: int = body["n"] if endpoint == "chat" and isinstance(body.get("n"), int) else 1
    return WorstCase(input_tokens, limit * max(1, n), cap_field)
