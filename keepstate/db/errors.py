"""What the database layer raises on purpose, placed in the one hierarchy of keepstate.errors.

    KeepStateError
    ├── Unavailable                 503
    │   └── DatabaseUnavailable     503  the database did not answer (down, unreachable, locked, timed out):
    │                                    `Retry-After: 2`, `Should-Retry: true` (docs/design/database.md)
    ├── BadDatabaseURL              500  a --db URL this release cannot use (said at start, never over HTTP)
    └── SchemaTooNew                500  the database is at a revision newer than this release knows (at start)
"""

from __future__ import annotations

from keepstate.errors import KeepStateError, Unavailable

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
