"""What every RPC handler needs from the request: the selected user, keepalive interval, deadline."""

from __future__ import annotations

from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from keepstate.agent.auth import AuthError, basic_auth_user
from keepstate.agent.settings import SandboxSettings
from keepstate.agent.users import BadPath, UnknownUser, User, lookup_user, resolve_path

DEFAULT_KEEPALIVE_S = 90.0  # envd's interval when the client sends no Keepalive-Ping-Interval


def request_user(settings: SandboxSettings, ctx: Any) -> User:
    try:
        name = basic_auth_user(ctx.request_headers.get("authorization")) or settings.default_user
        return lookup_user(name)
    except (AuthError, UnknownUser) as e:
        raise ConnectError(Code.UNAUTHENTICATED, str(e)) from None


def request_path(settings: SandboxSettings, path: str, user: User) -> str:
    try:
        return resolve_path(path, user, settings.default_workdir)
    except BadPath as e:
        raise ConnectError(Code.INVALID_ARGUMENT, str(e)) from None


def keepalive_interval(ctx: Any) -> float:
    raw = ctx.request_headers.get("keepalive-ping-interval")
    try:
        value = float(raw) if raw else DEFAULT_KEEPALIVE_S
    except ValueError:
        value = DEFAULT_KEEPALIVE_S
    return value if value > 0 else DEFAULT_KEEPALIVE_S


def deadline_at(ctx: Any, now: float) -> float | None:
    """When the caller's Connect-Timeout-Ms runs out, on the clock `now` was read from (the event loop's); None
    when it set no deadline. `Connect-Timeout-Ms: 0` is no deadline either, as in envd ("zero timeout means no
    timeout"); the SDK sends no header for `timeout=0`."""
    remaining = ctx.timeout_ms  # counted from the request's arrival
    if remaining is None or (ctx.request_headers.get("connect-timeout-ms") or "").strip() in ("", "0"):
        return None
    return float(now + max(remaining, 0.0) / 1000.0)


def deadline_exceeded() -> ConnectError:
    """How a stream ends when its deadline passes: what connect-go's handlers (envd's) end it with."""
    return ConnectError(Code.DEADLINE_EXCEEDED, "context deadline exceeded")
