"""Access-token and URL-signature checks (pure: no I/O)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

UNAUTHORIZED_MESSAGE = "unauthorized access, please provide a valid access token or method signing if supported"
EXPIRED_MESSAGE = "signature is already expired"


class AuthError(Exception):
    """Maps to HTTP 401 / Connect unauthenticated with this message."""


def token_ok(expected: str | None, presented: str | None) -> bool:
    """Without a configured token everything is accepted (a sandbox before /init)."""
    if expected is None:
        return True
    return presented is not None and hmac.compare_digest(expected.encode(), presented.encode())


def file_signature(path: str, operation: str, user: str | None, token: str, expiration: int | None) -> str:
    """The SDK's v1 signature: base64(sha256("path:op:user:token[:exp]")) without padding."""
    raw = f"{path}:{operation}:{user or ''}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode()


def check_file_access(
    *,
    token: str | None,
    header_token: str | None,
    path: str,
    operation: str,
    user: str | None,
    signature: str | None,
    expiration: str | None,
    now: float,
) -> None:
    """`/files` accepts the header token OR a valid signature; raises AuthError otherwise."""
    if token is None:
        return
    if header_token is not None:
        if not token_ok(token, header_token):
            raise AuthError(UNAUTHORIZED_MESSAGE)
        return
    if not signature:
        raise AuthError(UNAUTHORIZED_MESSAGE)
    exp: int | None = None
    if expiration:
        try:
            exp = int(expiration)
        except ValueError:
            raise AuthError("invalid signature expiration") from None
        if exp < now:
            raise AuthError(EXPIRED_MESSAGE)
    expected = file_signature(path, operation, user, token, exp)
    if not hmac.compare_digest(expected.encode(), signature.encode()):
        raise AuthError("invalid signature")


def basic_auth_user(header: str | None) -> str | None:
    """The user name from `Authorization: Basic base64("<user>:")`, or None when absent."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        raise AuthError(f"unsupported authorization scheme: {scheme!r}")
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise AuthError("invalid basic authorization header") from None
    user, _, _password = decoded.partition(":")
    return user or None
