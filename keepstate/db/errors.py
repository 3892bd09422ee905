"""What the database layer raises on purpose, placed in the one hierarchy of keepstate.errors.

    KeepStateError
    ├── Unavailable                 503
    │   └── DatabaseUnavailable     503  the database did not answer (down, unreachable, locked, timed out):
    │                                    `Retry-After: 2`, `Should-Retry: true` (docs/design/database.md)
    ├── Conflict                    409
    │   ├── Stale                   409  a conditional write found the row changed since the version it was given
    │   └── Fenced                  409  a conditional write found the row's epoch moved (another owner took it)
    ├── BadDatabaseURL              500  a --db URL this release cannot use (said at start, never over HTTP)
    └── SchemaTooNew                500  the database is at a revision newer than this release knows (at start)
"""

from __future__ import annotations

from keepstate.errors import Conflict, KeepStateError, Unavailable

RETRY_AFTER_S = 2


class DatabaseUnavailable(Unavailable):
    """A call that needed the database could not reach it. Nothing the call wrote was committed unless the commit
    itself was cut off (then the caller's next read says which): the design's lifecycle writes intent first, so a
    retry is safe, and the answer says so."""

    def __init__(self, message: str) -> None:
        super().__init__(f"the database is unavailable: {message}")

    def headers(self) -> dict[str, str]:
        return {"Should-Retry": "true", "Retry-After": str(RETRY_AFTER_S)}


class BadDatabaseURL(KeepStateError):
    pass


class SchemaTooNew(KeepStateError):
    def __init__(self, found: str, known: str) -> None:
        super().__init__(f"the database is at revision {found}, newer than this release ({known}): upgrade keepstate")
        self.found, self.known = found, known


class Stale(Conflict):
    """The row is not at the version the writer was given, because another write came first (for a claim of a
    pooled sandbox: the pooled row is gone). Nothing was written; the writer reads the row again and decides anew,
    never retrying the same write blindly."""


class Fenced(Conflict):
    """The row's epoch is not the one the writer was given: the sandbox was handed to another owner (issue 27's
    fencing token), and this writer must stop acting for it. Nothing was written."""
