"""Pure request parsing and list filtering, as the E2B SDK sends them."""

from __future__ import annotations

import time
from urllib.parse import quote, unquote, urlencode

import pytest

from keepstate.api import schemas
from keepstate.errors import BadRequest
from keepstate.sandbox.record import SandboxRow, Settings


def row(sid: str, started: float, state: str = "running", template: str = "base", **md: str) -> SandboxRow:
    return SandboxRow(sandbox_id=sid, state=state, template_id=template, template_digest="d", runtime_name="r",
                      slot=1, address="10.88.0.2", access_token="t", started_at=started, end_at=started + 300,
                      cpu=2, memory_mb=512, settings=Settings(metadata=md))


def sdk_metadata_param(md: dict[str, str]) -> str:
    """What aiohttp hands us after decoding the query once, for the SDK's triple-escaped metadata."""
    inner = urlencode({quote(k): quote(v) for k, v in md.items()})
    return unquote(quote(inner))


def test_metadata_filter_survives_triple_escaping() -> None:
    md = {"user": "a b", "k=": "v&", "plain": "x"}
    assert schemas.parse_metadata_filter(sdk_metadata_param(md)) == md


def test_metadata_filter_rejects_garbage() -> None:
    with pytest.raises(BadRequest):
        schemas.parse_metadata_filter("novalue")


def test_create_parsing_and_errors() -> None:
    req = schemas.parse_create({"templateID": " base ", "metadata": {"a": "b"}, "envVars": {"X": "1"}})
    assert req.template_id == "base" and req.timeout == 300 and req.env_vars == {"X": "1"} and req.gateway
    for bad in ({}, {"templateID": 3}, {"templateID": "b", "timeout": 0}, {"templateID": "b", "timeout": 86401},
                {"templateID": "b", "metadata": {"a": 1}}, {"templateID": "b", "autoPause": "yes"},
                {"templateID": "b", "memoryMB": 1}, {"templateID": "b", "timeout": True}, []):
        with pytest.raises(BadRequest):
            schemas.parse_create(bad)


def test_filter_state_template_started_after_and_order() -> None:
    now = time.time()
    rows = [row("a" * 20, now - 30, tag="x"), row("b" * 20, now - 20, state="paused", tag="x"),
            row("c" * 20, now - 10, template="other", tag="y")]
    page, token = schemas.filter_and_page(rows, {})
    assert [r.sandbox_id[0] for r in page] == ["c", "b", "a"] and token is None
    page, _ = schemas.filter_and_page(rows, {"state": "paused"})
    assert [r.sandbox_id[0] for r in page] == ["b"]
    page, _ = schemas.filter_and_page(rows, {"template": "other"})
    assert [r.sandbox_id[0] for r in page] == ["c"]
    page, _ = schemas.filter_and_page(rows, {"order": "asc", "metadata": "tag=x"})
    assert [r.sandbox_id[0] for r in page] == ["a", "b"]
    after = schemas.rfc3339(now - 20)
    page, _ = schemas.filter_and_page(rows, {"startedAfter": after})
    assert [r.sandbox_id[0] for r in page] == ["c", "b"]  # inclusive
    with pytest.raises(BadRequest):
        schemas.filter_and_page(rows, {"state": "dead"})
    with pytest.raises(BadRequest):
        schemas.filter_and_page(rows, {"limit": "0"})


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_pagination_visits_every_row_once(order: str) -> None:
    now = time.time()
    rows = [row(f"{i:020d}", now - i % 3) for i in range(7)]  # ties in startedAt
    seen, token = [], None
    while True:
        q = {"limit": "2", "order": order}
        if token:
            q["nextToken"] = token
        page, token = schemas.filter_and_page(rows, q)
        seen.extend(r.sandbox_id for r in page)
        if not token:
            break
    assert sorted(seen) == sorted(r.sandbox_id for r in rows) and len(seen) == len(set(seen))


def test_bad_cursor() -> None:
    with pytest.raises(BadRequest):
        schemas.filter_and_page([], {"nextToken": "%%%"})
