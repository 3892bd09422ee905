"""Times as the wire writes them: RFC 3339 in UTC with microseconds and a `Z`, as E2B's API does."""

from __future__ import annotations

from datetime import UTC, datetime


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
