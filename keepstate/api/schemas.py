"""E2B wire shapes: parse requests into typed values and render rows into responses.

Pure functions; the HTTP handlers only call these. Field names follow
shared/docs/e2b-protocol.md section 2.3 exactly (camelCase, except `allow_internet_access`).
"""

from __future__ import annotations

import base64
import time
from datetime import datetime, timezone
from typing import Any
from urllib.parse import unquote

from keepstate.db.catalog import SandboxRow
from keepstate.errors import BadRequest
from keepstate.sandbox.manager import DEFAULT_TIMEOUT, CreateRequest, check_timeout

CLIENT_ID = "6532622b"


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _str_map(body: dict[str, Any], key: str) -> dict[str, str]:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise BadRequest(f"`{key}` must be an object of string values")
    return dict(value)


def parse_create(body: Any) -> CreateRequest:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    template = body.get("templateID")
    if not isinstance(template, str) or not template.strip():
        raise BadRequest("`templateID` is required and must be a string")
    timeout = body.get("timeout", DEFAULT_TIMEOUT)
    timeout = check_timeout(timeout)
    if timeout <= 0:
        raise BadRequest("`timeout` must be a positive number of seconds")
    auto_pause = body.get("autoPause", False)
    if not isinstance(auto_pause, bool):
        raise BadRequest("`autoPause` must be a boolean")
    aia = body.get("allow_internet_access")
    if aia is not None and not isinstance(aia, bool):
        raise BadRequest("`allow_internet_access` must be a boolean")
    cpu = body.get("cpuCount")
    mem = body.get("memoryMB")
    if cpu is not None and (not isinstance(cpu, int | float) or isinstance(cpu, bool) or not 0 < cpu <= 64):
        raise BadRequest("`cpuCount` must be a number between 1 and 64")
    if mem is not None and (not isinstance(mem, int) or isinstance(mem, bool) or not 64 <= mem <= 65536):
        raise BadRequest("`memoryMB` must be a whole number between 64 and 65536")
    gateway = body.get("gateway", True)
    if not isinstance(gateway, bool):
        raise BadRequest("`gateway` must be a boolean")
    return CreateRequest(
        template_id=template.strip(), timeout=timeout, metadata=_str_map(body, "metadata"),
        env_vars=_str_map(body, "envVars"), auto_pause=auto_pause, cpu=cpu, memory_mb=mem,
        allow_internet_access=aia, gateway=gateway,
    )


def parse_timeout_body(body: Any, required: bool) -> int:
    if body is None or body == {}:
        if required:
            raise BadRequest("`timeout` is required")
        return DEFAULT_TIMEOUT
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if "timeout" not in body:
        if required:
            raise BadRequest("`timeout` is required")
        return DEFAULT_TIMEOUT
    return check_timeout(body["timeout"])


def sandbox(row: SandboxRow, envd_version: str) -> dict[str, Any]:
    return {
        "templateID": row.template_id, "sandboxID": row.sandbox_id, "alias": row.template_id,
        "clientID": CLIENT_ID, "envdVersion": envd_version, "envdAccessToken": row.access_token,
        "trafficAccessToken": None, "domain": None,
    }


def _common(row: SandboxRow, envd_version: str) -> dict[str, Any]:
    return {
        "templateID": row.template_id, "alias": row.template_id, "sandboxID": row.sandbox_id,
        "clientID": CLIENT_ID, "startedAt": rfc3339(row.started_at), "endAt": rfc3339(row.end_at),
        "envdVersion": envd_version, "cpuCount": max(1, int(row.cpu)), "memoryMB": row.memory_mb,
        "diskSizeMB": 1024, "state": "paused" if row.state == "paused" else "running",
        "metadata": row.doc.get("metadata", {}),
    }


def detail(row: SandboxRow, envd_version: str) -> dict[str, Any]:
    out = _common(row, envd_version)
    if row.state == "paused":
        out["pauseMode"] = "full"
    out.update({
        "envdAccessToken": row.access_token, "domain": None,
        "allowInternetAccess": row.doc.get("allowInternetAccess"),
        "lifecycle": {"autoResume": False, "onTimeout": "pause" if row.doc.get("autoPause") else "kill"},
    })
    return out


def listed(row: SandboxRow, envd_version: str) -> dict[str, Any]:
    return _common(row, envd_version)


# -- list filters ---------------------------------------------------------------------
def parse_metadata_filter(raw: str | None) -> dict[str, str]:
    """Decode the SDK's triple-escaped metadata filter like E2B's own API does.

    aiohttp has already query-decoded the parameter once; then the whole string is
    unescaped, split on & and =, and each key and value unescaped again.
    """
    if not raw:
        return {}
    whole = unquote(raw)
    out: dict[str, str] = {}
    for pair in whole.split("&"):
        if not pair:
            continue
        if "=" not in pair:
            raise BadRequest(f"invalid metadata filter pair '{pair}'")
        k, v = pair.split("=", 1)
        out[unquote(k)] = unquote(v)
    return out


def encode_cursor(row: SandboxRow, asc: bool) -> str:
    raw = f"{rfc3339(row.started_at)}__{row.sandbox_id}" + ("__asc" if asc else "")
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(token: str) -> tuple[float, str]:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        ts, sid = raw.split("__")[:2]
        return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp(), sid
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest("invalid `nextToken`") from exc


def parse_time(value: str, name: str) -> float:
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError as exc:
        raise BadRequest(f"`{name}` must be an RFC 3339 time, e.g. 2026-01-01T00:00:00Z") from exc


def filter_and_page(rows: list[SandboxRow], query: dict[str, str]) -> tuple[list[SandboxRow], str | None]:
    """Apply state, metadata, template, startedAfter, order, limit and nextToken."""
    states = {"running", "paused"}
    if query.get("state"):
        states = {s.strip() for s in query["state"].split(",") if s.strip()}
        bad = states - {"running", "paused"}
        if bad:
            raise BadRequest(f"invalid state {sorted(bad)}; allowed: running, paused")
    meta = parse_metadata_filter(query.get("metadata"))
    template = query.get("template")
    after = parse_time(query["startedAfter"], "startedAfter") if query.get("startedAfter") else None
    order = query.get("order", "desc").lower()
    if order not in ("asc", "desc"):
        raise BadRequest("`order` must be asc or desc")
    try:
        limit = int(query.get("limit", "100"))
    except ValueError:
        raise BadRequest("`limit` must be a whole number") from None
    if not 1 <= limit <= 100:
        raise BadRequest("`limit` must be between 1 and 100")

    def keep(r: SandboxRow) -> bool:
        state = "paused" if r.state == "paused" else "running"
        md = r.doc.get("metadata", {})
        return (state in states and all(md.get(k) == v for k, v in meta.items())
                and (template is None or r.template_id == template)
                and (after is None or r.started_at >= after - 1e-6))

    asc = order == "asc"
    selected = sorted((r for r in rows if keep(r)), key=lambda r: (r.started_at, r.sandbox_id), reverse=not asc)
    if query.get("nextToken"):
        ts, sid = decode_cursor(query["nextToken"])
        key = (round(ts, 6), sid)
        if asc:
            selected = [r for r in selected if (round(r.started_at, 6), r.sandbox_id) > key]
        else:
            selected = [r for r in selected if (round(r.started_at, 6), r.sandbox_id) < key]
    page = selected[:limit]
    token = encode_cursor(page[-1], asc) if len(selected) > limit else None
    return page, token


def now() -> float:
    return time.time()
