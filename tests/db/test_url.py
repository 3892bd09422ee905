"""--db URLs: an accepted one becomes the design's SQLAlchemy URL; the rest are refused, their password masked."""

from __future__ import annotations

from pathlib import Path

import pytest

from keepstate.db.errors import BadDatabaseURL
from keepstate.db.url import default_url, mask, parse


@pytest.mark.parametrize(("given", "kind", "sqlalchemy_url"), [
    ("sqlite:////var/lib/keepstate/keepstate.sqlite", "sqlite", "sqlite:////var/lib/keepstate/keepstate.sqlite"),
    ("sqlite:///relative/k.sqlite", "sqlite", "sqlite:///relative/k.sqlite"),
    ("postgresql://postgres@/ks?host=/tmp/pg-dir", "postgresql", "postgresql+psycopg://postgres@/ks?host=/tmp/pg-dir"),
    ("postgres://u:p%40ss@db.internal:5433/ks?sslmode=verify-full&passfile=/etc/ks/pgpass&host=/a&host=/b",
     "postgresql",
     "postgresql+psycopg://u:p%40ss@db.internal:5433/ks?sslmode=verify-full&passfile=/etc/ks/pgpass&host=/a&host=/b"),
    ("postgresql:///ks?service=keepstate", "postgresql", "postgresql+psycopg:///ks?service=keepstate"),
    ("POSTGRESQL://h/ks", "postgresql", "postgresql+psycopg://h/ks"),
])
def test_accepted_urls_keep_everything_after_the_scheme(given: str, kind: str, sqlalchemy_url: str) -> None:
    got = parse(given)
    assert (got.kind, got.sqlalchemy_url) == (kind, sqlalchemy_url)


def test_sqlite_path_and_the_default_url(tmp_path: Path) -> None:
    assert parse("sqlite:////srv/ks/keepstate.sqlite").path == Path("/srv/ks/keepstate.sqlite")
    assert default_url(Path("/var/lib/keepstate")) == "sqlite:////var/lib/keepstate/keepstate.sqlite"
    odd = tmp_path / "a dir?#%"  # characters a URL would read as its own: quoted, and read back as the same path
    assert parse(default_url(odd)).path == odd / "keepstate.sqlite"


@pytest.mark.parametrize(("given", "why"), [
    ("", "not a URL"),
    ("/var/lib/keepstate/keepstate.sqlite", "not a URL"),
    ("mysql://u:hunter2@h/ks", "unknown scheme mysql://"),
    ("postgresql+asyncpg://u:hunter2@h/ks", "unknown scheme postgresql+asyncpg://"),
    ("sqlite+aiosqlite:///k.sqlite", "unknown scheme"),
    ("sqlite://host/k.sqlite", "names no host"),
    ("sqlite:///", "path of a file"),
    ("sqlite:///:memory:", "path of a file"),
    ("postgresql://u:hunter2@h:port/ks", "Port could not be cast"),
    ("postgresql://u@h/ks?sslmode=require&password=hunter2", ""),
])
def test_refused_urls_say_what_is_accepted_and_never_the_password(given: str, why: str) -> None:
    if given.endswith("password=hunter2"):  # a password as a libpq parameter is accepted, and masked when shown
        assert parse(given).shown == "postgresql://u@h/ks?sslmode=require&password=***"
        return
    with pytest.raises(BadDatabaseURL) as refused:
        parse(given)
    message = refused.value.message
    assert why in message and "hunter2" not in message
    assert "sqlite:///PATH" in message and "postgresql://" in message


@pytest.mark.parametrize(("given", "shown"), [
    ("postgresql://u:hunter2@h:5432/ks", "postgresql://u:***@h:5432/ks"),
    ("postgresql://u:pa:ss@w@h/ks?x=1", "postgresql://u:***@h/ks?x=1"),
    ("postgresql://u@h/ks", "postgresql://u@h/ks"),
    ("postgresql:///ks?host=/d&password=hunter2&sslmode=disable", "postgresql:///ks?host=/d&password=***&sslmode=disable"),
    ("sqlite:////tmp/x.sqlite", "sqlite:////tmp/x.sqlite"),
])
def test_mask(given: str, shown: str) -> None:
    assert mask(given) == shown
