"""What every repository needs: rows to records and back, the one statement that differs by database (an INSERT
that does something on a conflict), and telling a broken UNIQUE constraint from any other error."""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Iterable
from typing import Any, TypeVar

import psycopg
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Row

from keepstate.db.url import Kind

R = TypeVar("R")

# SQLite's extended result codes for a UNIQUE or PRIMARY KEY constraint; PostgreSQL's is SQLSTATE 23505.
_SQLITE_DUPLICATE = ("SQLITE_CONSTRAINT_UNIQUE", "SQLITE_CONSTRAINT_PRIMARYKEY")


def columns(rec: Any, *, leave_out: Iterable[str] = ()) -> dict[str, Any]:
    """A record's fields as column values (a record's fields are named after its columns)."""
    out = {f.name: getattr(rec, f.name) for f in dataclasses.fields(rec)}
    for name in leave_out:
        out.pop(name, None)
    return out


def record(cls: type[R], row: Row[Any], **extra: Any) -> R:
    """The record `cls` of a row whose columns are its fields (`extra`: fields that are not columns)."""
    return cls(**row._mapping, **extra)


def duplicate(e: sa.exc.IntegrityError) -> bool:
    """Whether `e` is a UNIQUE or PRIMARY KEY constraint broken (not NOT NULL, CHECK or a trigger's refusal)."""
    orig = e.orig
    if isinstance(orig, psycopg.errors.UniqueViolation):
        return True
    return isinstance(orig, sqlite3.IntegrityError) and getattr(orig, "sqlite_errorname", "") in _SQLITE_DUPLICATE


def insert_or_ignore(kind: Kind, table: sa.Table, key: list[str], values: dict[str, Any]) -> sa.Insert:
    """INSERT … ON CONFLICT (key) DO NOTHING, on either database."""
    if kind == "postgresql":
        return postgresql.insert(table).values(**values).on_conflict_do_nothing(index_elements=key)
    return sqlite_dialect.insert(table).values(**values).on_conflict_do_nothing(index_elements=key)


def upsert(kind: Kind, table: sa.Table, key: list[str], values: dict[str, Any]) -> sa.Insert:
    """INSERT … ON CONFLICT (key) DO UPDATE SET every other column given, on either database."""
    changed = {name: value for name, value in values.items() if name not in key}
    if kind == "postgresql":
        return postgresql.insert(table).values(**values).on_conflict_do_update(index_elements=key, set_=changed)
    return sqlite_dialect.insert(table).values(**values).on_conflict_do_update(index_elements=key, set_=changed)
