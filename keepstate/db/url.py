"""`--db URL` (and KEEPSTATE_DB): what an operator writes, turned into what SQLAlchemy takes.

    sqlite:///PATH              -> sqlite:///PATH (stdlib sqlite3) (PATH as written: sqlite:////var/lib/x is absolute)
    postgresql://... postgres://... -> postgresql+psycopg://...  (everything after the scheme kept byte for byte: the
                                                                query string goes to libpq as it is, ?host=/dir too)

Anything else is refused with the URL, its password masked, and what is accepted. Pure functions: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import quote, unquote, urlsplit

from keepstate.db.errors import BadDatabaseURL

Kind = Literal["sqlite", "postgresql"]

ACCEPTED = ("sqlite:///PATH (a file; sqlite:////abs/path.sqlite for an absolute path) or "
            "postgresql://USER[:PASSWORD]@[HOST][:PORT]/NAME[?libpq parameters, e.g. host=/run/postgresql] "
            "(postgres:// too)")

_POSTGRES_SCHEMES = ("postgresql", "postgres")
_QUERY_PASSWORD = re.compile(r"(?<=[?&])(password=)[^&#]*", re.IGNORECASE)


@dataclass(frozen=True)
class DatabaseURL:
    kind: Kind
    sqlalchemy_url: str  # for create_async_engine
    shown: str  # the URL as given with its password masked: for messages and logs
    path: Path | None = None  # SQLite's file


def mask(url: str) -> str:
    """`url` with any password (in the user part or as a libpq `password=` parameter) replaced by ***."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return _QUERY_PASSWORD.sub(r"\1***", url)
    end = len(rest)
    for stop in "/?#":
        at = rest.find(stop)
        if at != -1:
            end = min(end, at)
    netloc, tail = rest[:end], rest[end:]
    userinfo, at_sign, hostport = netloc.rpartition("@")
    if at_sign and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hostport}"
    tail = _QUERY_PASSWORD.sub(r"\1***", tail)
    return f"{scheme}://{netloc}{tail}"


def parse(url: str) -> DatabaseURL:
    """The database `url` names, or BadDatabaseURL saying what is accepted."""
    shown = mask(url)
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep:
        raise _bad(shown, "not a URL")
    if scheme == "sqlite":
        if not rest.startswith("/"):
            raise _bad(shown, "an SQLite URL names no host: sqlite:///PATH")
        path = unquote(rest[1:].split("?", 1)[0])
        if not path or path == ":memory:":
            raise _bad(shown, "an SQLite URL needs the path of a file")
        return DatabaseURL("sqlite", "sqlite://" + rest, shown, Path(path))
    if scheme in _POSTGRES_SCHEMES:
        try:
            _ = urlsplit("postgresql://" + rest).port  # a port that is not a number is refused here, not at connect
        except ValueError as e:
            raise _bad(shown, str(e)) from None
        return DatabaseURL("postgresql", "postgresql+psycopg://" + rest, shown)
    raise _bad(shown, f"unknown scheme {scheme}://")


def default_url(home: Path | str) -> str:
    """The embedded default: one SQLite file in the data directory."""
    return "sqlite:///" + quote(f"{home}/keepstate.sqlite", safe="/")


def _bad(shown: str, why: str) -> BadDatabaseURL:
    return BadDatabaseURL(f"--db {shown}: {why}; accepted: {ACCEPTED}")
