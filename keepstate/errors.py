"""The one error hierarchy; every HTTP error renders as JSON {"code": <int>, "message": <str>}.

    KeepStateError            500, base of everything we raise on purpose
    ├── BadRequest            400  malformed input: says which field and what is allowed
    ├── Unauthorized          401  missing or wrong API key / access token
    ├── NotFound              404  unknown sandbox, template, snapshot, checkpoint
    ├── Conflict              409  illegal in the current lifecycle state (already paused, ...)
    ├── PayloadTooLarge       413
    ├── TooMany               429  an API key's limit of running sandboxes is reached
    ├── Unavailable           503  capacity or a dependency is missing right now
    │   └── Busy              503  the host is busy starting sandboxes: retry after `retry_after` seconds
    ├── Refused               422  understood but refused for safety (e.g. incompatible restore)
    └── Unsupported           501  a feature this server does not offer (said loudly, never ignored)

A 5xx carries `Should-Retry: false` (the SDK must not repeat a call that may have had effects), except Busy: it
is refused before anything was done, so it says `Should-Retry: true` and `Retry-After` (docs/design/admission.md).
"""

from __future__ import annotations


class KeepStateError(Exception):
    status = 500

    def __init__(self, message: str, *, error_code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.error_code = error_code

    def body(self) -> dict[str, object]:
        out: dict[str, object] = {"code": self.status, "message": self.message}
        if self.error_code:
            out["error_code"] = self.error_code
        return out

    def headers(self) -> dict[str, str]:
        return {"Should-Retry": "false"} if self.status >= 500 else {}


class BadRequest(KeepStateError):
    status = 400


class Unauthorized(KeepStateError):
    status = 401


class NotFound(KeepStateError):
    status = 404


class Conflict(KeepStateError):
    status = 409


class InProgress(Conflict):
    """Another request with the same idempotency key is still running (409 `idempotency_in_progress`): the client
    retries with the same key after `retry_after` seconds."""

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, error_code="idempotency_in_progress")
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Should-Retry": "true", "Retry-After": str(self.retry_after)}


class PayloadTooLarge(KeepStateError):
    status = 413


class TooMany(KeepStateError):
    status = 429

    def headers(self) -> dict[str, str]:
        return {"Should-Retry": "false"}  # only a kill or a pause frees a place: an immediate retry is refused again


class Refused(KeepStateError):
    status = 422


class Unavailable(KeepStateError):
    status = 503


class Full(Unavailable):
    """A limit of places is reached: an immediate retry is refused again; one after `retry_after` may find one (a
    sandbox ended meanwhile). E2B's `sandbox_capacity_unavailable`."""

    def __init__(self, message: str, *, retry_after: int, error_code: str = "sandbox_capacity_unavailable") -> None:
        super().__init__(message, error_code=error_code)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Should-Retry": "false", "Retry-After": str(self.retry_after)}


class Busy(Unavailable):
    def __init__(self, message: str, *, retry_after: int, error_code: str | None = None) -> None:
        super().__init__(message, error_code=error_code)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Should-Retry": "true", "Retry-After": str(self.retry_after)}


class Draining(Unavailable):
    """This node takes no creates (an operator drained it): another node must, and asking this one again will not
    help."""

    def __init__(self, message: str) -> None:
        super().__init__(message, error_code="sandbox_capacity_unavailable")

    def headers(self) -> dict[str, str]:
        return {"Should-Retry": "false"}


class Unsupported(KeepStateError):
    status = 501
