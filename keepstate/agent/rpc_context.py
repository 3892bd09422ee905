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


def deadline_s(ctx: Any) -> float | None:
    """Seconds left of the caller's Connect-Timeout-Ms, or None when it sent none."""
    remaining = ctx.timeout_ms
    return None if remaining is None else max(remaining, 0.0) / 1000.0
