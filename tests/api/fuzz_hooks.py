"""Schemathesis hooks for tests/api/test_fuzz.py (loaded by the `schemathesis run` it starts, not by pytest)."""

from __future__ import annotations

import json
from typing import Any

import schemathesis


@schemathesis.check
def error_is_code_and_message(ctx: Any, response: Any, case: Any) -> None:
    """Every error is JSON {"code": <its status>, "message": <str>}, as the e2b SDK parses it."""
    if response.status_code < 400:
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"a {response.status_code} whose body is not JSON: {response.content[:200]!r}") from None
    code = body.get("code") if isinstance(body, dict) else None
    if type(code) is not int or code != response.status_code or not isinstance(body.get("message"), str):
        raise AssertionError(f'a {response.status_code} whose body is not {{"code": {response.status_code}, '
                             f'"message": "..."}}: {response.content[:300]!r}')
    return None
