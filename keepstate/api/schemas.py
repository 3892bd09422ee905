"""E2B wire shapes: parse requests into typed values and render rows into responses.

Pure functions; the HTTP handlers only call these. Field names follow
shared/docs/e2b-protocol.md section 2.3 exactly (camelCase, except `allow_internet_access`).
"""

from __future__ import annotations

import base64
import json
import math
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any, overload
from urllib.parse import unquote

from keepstate.clock import rfc3339
from keepstate.egress import policy
from keepstate.errors import BadRequest
from keepstate.mountpoints import VOLUME_SLOTS
from keepstate.sandbox.manager import DEFAULT_TIMEOUT, MAX_TIMEOUT, CreateRequest, check_timeout
from keepstate.sandbox.record import SandboxRow
from keepstate.sandbox.state import PUBLIC

CLIENT_ID = "6532622b"
MIN_CPU, MAX_CPU = 0.01, 64
MIN_MEMORY_MB, MAX_MEMORY_MB = 64, 65536
MIN_DISK_MB, MAX_DISK_MB = 64, 1 << 20  # our extension `diskSizeMB`: 64 MiB to 1 TiB
MAX_FORKS = 20  # as keepstate.sandbox.checkpointing.MAX_FORKS


# -- request bodies ----------------------------------------------------------------------
MAX_JSON_DEPTH = 64  # E2B's bodies nest three levels deep; deeper input is refused before anything walks it


def _not_json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _check_tree(value: Any) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and strings with lone surrogates (`"\\ud800"`, valid JSON that
    no UTF-8 encoder, SQLite binding or process environment accepts), iteratively."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise BadRequest(f"malformed JSON body: a string holds the lone surrogate "
                                 f"\\u{ord(item[exc.start]):04x}, which is not a character") from None
            continue
        if not isinstance(item, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"malformed JSON body: nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, dict):
            stack.extend((k, depth) for k in item)
            stack.extend((v, depth + 1) for v in item.values())
        else:
            stack.extend((v, depth + 1) for v in item)


def parse_json(raw: bytes, required: bool = True) -> Any:
    """A request body as JSON (RFC 8259: UTF-8, finite numbers); every way it can be wrong is a BadRequest.

    An empty body is None, or a BadRequest when `required`; whitespace alone is not JSON (a 400).
    """
    if not raw:
        if required:
            raise BadRequest("request body must be JSON")
        return None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start} "
                         f"({exc.reason}); JSON bodies must be UTF-8") from None
    try:
        value = json.loads(text, parse_constant=_not_json_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON body: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise BadRequest(f"malformed JSON body: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # NaN/Infinity, 1e999, integers past Python's 4300-digit limit
        raise BadRequest(f"malformed JSON body: {exc}") from None
    _check_tree(value)
    return value


def parse_object(raw: bytes) -> dict[str, Any]:
    """An optional JSON object body: empty means {}; anything but an object (`[]`, `0`, `null`, blanks) is a
    BadRequest."""
    if not raw:
        return {}
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _number(value: Any, name: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"`{name}` must be a number")
    return value


def _seconds(value: Any, name: str = "timeout", limit: int = MAX_TIMEOUT) -> int:
    """A number of seconds (a fraction is truncated), at most `limit` (`serve --max-timeout`, 24 hours by default;
    0: none)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"`{name}` must be a whole number of seconds")
    return check_timeout(value, name, limit)


def _str_map(body: dict[str, Any], key: str) -> dict[str, str]:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise BadRequest(f"`{key}` must be an object of string values")
    return dict(value)


def _env_vars(body: dict[str, Any]) -> dict[str, str]:
    env = _str_map(body, "envVars")
    for k, v in env.items():
        if not k or "=" in k or "\0" in k:
            raise BadRequest(f"`envVars`: {k!r} is not a variable name (it must be non-empty, without '=' or NUL)")
        if "\0" in v:
            raise BadRequest(f"`envVars`: the value of {k!r} holds a NUL character")
    return env


MAX_MCP_SERVERS = 64


def _check_mcp(mcp: Any) -> None:
    """E2B's `mcp` object: the SDK hands it to the sandbox's `mcp-gateway` (docs/design/mcp-gateway.md), which checks
    each server; here only its shape, so that a bad one is a 400 before a sandbox is made."""
    if mcp is None:
        return
    if not isinstance(mcp, dict) or not all(isinstance(v, dict) for v in mcp.values()):
        raise BadRequest("`mcp` must be an object of MCP servers, each with an object of settings (e.g. "
                         "{\"time\": {}})")
    if len(mcp) > MAX_MCP_SERVERS:
        raise BadRequest(f"`mcp` names {len(mcp)} servers; at most {MAX_MCP_SERVERS}")


def parse_create(body: Any, limit: int = MAX_TIMEOUT) -> CreateRequest:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    template = body.get("templateID")
    if not isinstance(template, str) or not template.strip():
        raise BadRequest("`templateID` is required and must be a string")
    _check_mcp(body.get("mcp"))
    timeout = _seconds(body.get("timeout", DEFAULT_TIMEOUT), limit=limit)
    if timeout <= 0:
        raise BadRequest("`timeout` must be a positive number of seconds")
    auto_pause = body.get("autoPause", False)
    if not isinstance(auto_pause, bool):
        raise BadRequest("`autoPause` must be a boolean")
    aia = body.get("allow_internet_access")
    if aia is not None and not isinstance(aia, bool):
        raise BadRequest("`allow_internet_access` must be a boolean")
    network = policy.parse(body.get("network"), allow_internet_access=aia)
    cpu = body.get("cpuCount")
    mem = body.get("memoryMB")
    # A cgroup's CPU quota is at least 1 ms per 100 ms period: 0.01 CPUs.
    if cpu is not None and not MIN_CPU <= _number(cpu, "cpuCount") <= MAX_CPU:
        raise BadRequest(f"`cpuCount` must be a number from {MIN_CPU} to {MAX_CPU}")
    if mem is not None:
        if _number(mem, "memoryMB") != int(mem) or not MIN_MEMORY_MB <= mem <= MAX_MEMORY_MB:
            raise BadRequest(f"`memoryMB` must be a whole number between {MIN_MEMORY_MB} and {MAX_MEMORY_MB}")
        mem = int(mem)
    disk = body.get("diskSizeMB")
    if disk is not None:
        if _number(disk, "diskSizeMB") != int(disk) or not MIN_DISK_MB <= disk <= MAX_DISK_MB:
            raise BadRequest(f"`diskSizeMB` must be a whole number between {MIN_DISK_MB} and {MAX_DISK_MB}")
        disk = int(disk)
    pause_memory = body.get("autoPauseMemory", True)
    if not isinstance(pause_memory, bool):
        raise BadRequest("`autoPauseMemory` must be a boolean")
    gateway = body.get("gateway", True)
    if not isinstance(gateway, bool):
        raise BadRequest("`gateway` must be a boolean")
    every = body.get("checkpointEvery")
    if every is not None and (_number(every, "checkpointEvery") != int(every) or not 0 <= every <= 86400):
        raise BadRequest("`checkpointEvery` must be a whole number of seconds from 0 to 86400")
    auto_resume = parse_auto_resume(body.get("autoResume"))
    if auto_resume and not auto_pause:
        raise BadRequest("`autoResume` needs `autoPause: true` (lifecycle on_timeout \"pause\"): only a paused "
                         "sandbox can be resumed by its traffic")
    if auto_resume and not pause_memory:
        raise BadRequest("`autoResume` cannot be combined with `autoPauseMemory: false`: a filesystem-only pause "
                         "is resumed explicitly (Sandbox.connect)")
    return CreateRequest(
        template_id=template.strip(), timeout=timeout, metadata=_str_map(body, "metadata"),
        env_vars=_env_vars(body), auto_pause=auto_pause, cpu=cpu, memory_mb=mem, disk_mb=disk,
        auto_pause_memory=pause_memory, allow_internet_access=aia, gateway=gateway,
        volume_mounts=parse_volume_mounts(body.get("volumeMounts")),
        network=network.to_json(), auto_resume=auto_resume, checkpoint_every=int(every or 0),
    )


def parse_auto_resume(value: Any) -> bool:
    """`autoResume` of a create: E2B's `{"enabled": bool}` (the SDK's wire), its earlier `{"policy": "any"|"off"}`,
    or a bare boolean; absent or null is off."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, dict) and set(value) == {"enabled"} and isinstance(value["enabled"], bool):
        return bool(value["enabled"])
    if isinstance(value, dict) and set(value) == {"policy"} and value["policy"] in ("any", "off"):
        return bool(value["policy"] == "any")
    raise BadRequest('`autoResume` must be {"enabled": true|false} (or {"policy": "any"|"off"}, or a boolean)')


MAX_MOUNTS = VOLUME_SLOTS  # the runtime has this many mount points for volumes
# Where the sandbox's own machinery lives: a volume may not cover it, nor sit inside it.
SYSTEM_PATHS = ("/proc", "/dev", "/sys", "/opt/keepstate")


def _under(path: str, top: str) -> bool:
    return top == "/" or path == top or path.startswith(top + "/")


def parse_volume_mounts(mounts: Any) -> list[tuple[str, str]]:
    """`volumeMounts: [{name, path}]`: (volume name, normalised absolute path); the volumes' existence is the
    manager's to check. A path is absolute, not `/`, holds no `.`/`..`, does not cover or sit in a system path,
    and no two mounts nest."""
    if mounts is None:
        return []
    if not isinstance(mounts, list):
        raise BadRequest("`volumeMounts` must be a list of {name, path}")
    if len(mounts) > MAX_MOUNTS:
        raise BadRequest(f"`volumeMounts` holds at most {MAX_MOUNTS} mounts")
    out: list[tuple[str, str]] = []
    for i, m in enumerate(mounts):
        where = f"`volumeMounts[{i}]`"
        if not isinstance(m, dict) or not isinstance(m.get("name"), str) or not isinstance(m.get("path"), str):
            raise BadRequest(f"{where} must be an object {{name: string, path: string}}")
        name, raw = m["name"], m["path"]
        if not name:
            raise BadRequest(f"{where}.name must name a volume")
        if not raw.startswith("/") or "\0" in raw or len(raw) > 1024:
            raise BadRequest(f"{where}.path must be an absolute path (e.g. /mnt/data), got {raw!r}")
        parts = [p for p in raw.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise BadRequest(f"{where}.path may not contain `.` or `..`, got {raw!r}")
        path = "/" + "/".join(parts)
        if path == "/":
            raise BadRequest(f"{where}.path may not be `/`")
        for system in SYSTEM_PATHS:
            if _under(path, system) or _under(system, path):
                raise BadRequest(f"{where}.path {path} would cover or sit inside {system}, which the sandbox "
                                 "needs; choose another (e.g. /mnt/data)")
        for other_name, other in out:
            if _under(path, other) or _under(other, path):
                raise BadRequest(f"{where}.path {path} is at or inside the mount {other} (of {other_name!r}); "
                                 "mounts may not nest")
        out.append((name, path))
    return out


def parse_timeout_body(body: Any, required: bool, limit: int = MAX_TIMEOUT) -> int:
    """`{"timeout": seconds}`. Required (set_timeout): 0 or less expires the sandbox now. Optional (connect, fork):
    absent means the default, and it must be positive."""
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
    seconds = _seconds(body["timeout"], limit=limit)
    if not required and seconds <= 0:
        raise BadRequest("`timeout` must be a positive number of seconds")
    return seconds


@overload
def query_int(query: Mapping[str, str], name: str, default: int, low: int, high: int) -> int: ...


@overload
def query_int(query: Mapping[str, str], name: str, default: None, low: int, high: int) -> int | None: ...


def query_int(query: Mapping[str, str], name: str, default: int | None, low: int, high: int) -> int | None:
    """An integer query parameter from `low` to `high`; absent or empty means `default`."""
    raw = query.get(name, "")
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"query parameter `{name}` must be a whole number, got {raw!r}") from None
    if not low <= value <= high:
        raise BadRequest(f"query parameter `{name}` must be from {low} to {high}")
    return value


def query_bool(query: Mapping[str, str], name: str) -> bool:
    """A boolean query parameter: true or 1, false or 0 (any case); absent or empty means false."""
    raw = query.get(name, "").lower()
    if raw in ("", "false", "0"):
        return False
    if raw in ("true", "1"):
        return True
    raise BadRequest(f"query parameter `{name}` must be true or false, got {raw!r}")


def query_choice(query: Mapping[str, str], name: str, allowed: tuple[str, ...]) -> str | None:
    """A query parameter that is one of `allowed`; None when absent or empty."""
    raw = query.get(name, "")
    if raw == "":
        return None
    if raw not in allowed:
        raise BadRequest(f"query parameter `{name}` must be one of {', '.join(allowed)}, got {raw!r}")
    return raw


def _memory(body: dict[str, Any]) -> bool:
    """`memory` of a pause, snapshot, fork or resume: whether memory is kept (default true)."""
    memory = body.get("memory", True)
    if not isinstance(memory, bool):
        raise BadRequest("`memory` must be a boolean")
    return memory


def _whole(value: Any, low: int, high: int, message: str) -> int:
    """A whole number from `low` to `high` (a float with no fraction counts, a boolean does not)."""
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(message)
    return value


def parse_pause_body(body: dict[str, Any]) -> tuple[bool, bool]:
    """`{"memory"?: bool, "requireHealthyGuest"?: bool}` of a pause (SDK 2.63): (keep memory, default true; refuse
    unless the agent answers, default false)."""
    healthy = body.get("requireHealthyGuest", False)
    if not isinstance(healthy, bool):
        raise BadRequest("`requireHealthyGuest` must be a boolean")
    return _memory(body), healthy


def parse_snapshot_body(body: dict[str, Any]) -> tuple[str | None, bool]:
    """`{"name"?: str, "memory"?: bool}` of a snapshot: (name, memory)."""
    name = body.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip() or len(name) > 128):
        raise BadRequest("`name` must be a non-empty string of at most 128 characters")
    return name, _memory(body)


def parse_fork_body(body: dict[str, Any], limit: int = MAX_TIMEOUT) -> tuple[int, int]:
    """`{"count"?: 1..20, "timeout"?: seconds}` of a fork: (count, timeout)."""
    count = _whole(body.get("count", 1), 1, MAX_FORKS, f"`count` must be a whole number from 1 to {MAX_FORKS}")
    return count, parse_timeout_body(body, required=False, limit=limit)


def parse_fork_memory(body: dict[str, Any]) -> bool:
    """`memory` of a fork (v2): whether the forks start from memory (default) or cold from the files."""
    return _memory(body)


REFRESH_DEFAULT = 15  # seconds, E2B's
REFRESH_MAX = 3600
RESUME_DEFAULT_TIMEOUT = 15  # seconds, E2B's ResumedSandbox


def parse_refresh_body(body: dict[str, Any]) -> int:
    """`{"duration"?: 0..3600}` of a refresh: seconds to keep the sandbox alive from now (default 15)."""
    return _whole(body.get("duration", REFRESH_DEFAULT), 0, REFRESH_MAX,
                  f"`duration` must be a whole number of seconds from 0 to {REFRESH_MAX}")


def parse_resume_body(body: dict[str, Any], limit: int = MAX_TIMEOUT) -> tuple[int, bool | None, bool]:
    """`{"timeout"?: seconds (15), "autoPause"?: bool, "memory"?: bool}` of E2B's older resume:
    (timeout, auto_pause or None when absent, memory)."""
    timeout = parse_timeout_body(body, required=False, limit=limit) if "timeout" in body else RESUME_DEFAULT_TIMEOUT
    auto_pause = body.get("autoPause")
    if auto_pause is not None and not isinstance(auto_pause, bool):
        raise BadRequest("`autoPause` must be a boolean")
    return timeout, auto_pause, _memory(body)


def sandbox(row: SandboxRow, envd_version: str, domain: str | None = None) -> dict[str, Any]:
    """Create's, connect's, resume's and fork's answer. `domain` is the server's (`serve --domain`): the SDK's
    `get_host(port)` is `<port>-<sandboxID>.<domain>`, which the router serves."""
    return {
        "templateID": row.template_id, "sandboxID": row.sandbox_id, "alias": row.template_id,
        "clientID": CLIENT_ID, "envdVersion": envd_version, "envdAccessToken": row.access_token,
        "trafficAccessToken": row.settings.traffic_token, "domain": domain,
    }


def _common(row: SandboxRow, envd_version: str, domain: str | None = None) -> dict[str, Any]:
    return {
        "domain": domain,
        "templateID": row.template_id, "alias": row.template_id, "sandboxID": row.sandbox_id,
        "clientID": CLIENT_ID, "startedAt": rfc3339(row.started_at), "endAt": rfc3339(row.end_at),
        "envdVersion": envd_version, "cpuCount": max(1, int(row.cpu)), "memoryMB": row.memory_mb,
        "diskSizeMB": row.settings.disk_mb, "state": PUBLIC.get(row.state, "running"),
        "metadata": dict(row.settings.metadata),
        "volumeMounts": [{"name": m["name"], "path": m["path"]} for m in row.settings.volume_mounts],
    }


def detail(row: SandboxRow, envd_version: str, domain: str | None = None) -> dict[str, Any]:
    out = _common(row, envd_version, domain)
    if PUBLIC.get(row.state) == "paused":
        out["pauseMode"] = "filesystem" if row.settings.files_only else "full"
        if row.settings.envd_unresponsive:
            out["envdUnresponsiveAtPause"] = True
    out.update({
        "envdAccessToken": row.access_token, "trafficAccessToken": row.settings.traffic_token,
        "allowInternetAccess": row.settings.policy.allow_internet_access,
        "network": row.settings.policy.to_wire(),
        "lifecycle": {"autoResume": row.settings.auto_resume,
                      "onTimeout": "pause" if row.settings.auto_pause else "kill"},
    })
    return out


def listed(row: SandboxRow, envd_version: str, domain: str | None = None) -> dict[str, Any]:
    return _common(row, envd_version, domain)


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
    except (ValueError, OverflowError) as exc:  # binascii.Error and UnicodeDecodeError are ValueErrors
        raise BadRequest("invalid `nextToken`") from exc


def parse_time(value: str, name: str) -> float:
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except (ValueError, OverflowError) as exc:
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
        state = PUBLIC.get(r.state, "running")
        md = r.settings.metadata
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
