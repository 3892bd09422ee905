"""The upgrade in place of a data directory written before the one database (docs/design/database.md,
"Migrations and the upgrade of existing data directories").

Releases before it kept three SQLite files in `$KEEPSTATE_HOME`: `catalog.sqlite` (schema versions 1 to 4),
`sessions.sqlite` (1) and `gateway.sqlite` (1 or 2). `import_home` copies every row of them into the database in
ONE transaction, then renames each file `*.imported`:

- a column an older version of a file lacks is left to the new table's default (NULL for every such column), so
  no old upgrade step needs to run first; a table an older file lacks is skipped;
- values are copied as they are, hashes byte for byte: every session chain verifies afterwards;
- the catalog's snapshots keep their names in a JSON list: each becomes a row of `snapshot_names`; the secrets key's
  fingerprint moves from the catalog's `meta` to `secrets_key`; sandboxes get `node_id` (this server's node);
- a crash before the commit leaves the database empty and the files untouched: the next start imports again; a crash
  between the commit and the renames leaves files whose rows are all in the database: they are recognised as
  imported (every key, sandbox, session and run of them is there) and only renamed.

It runs when the database is empty of everything the files hold; a database holding other data and files that are
not in it are refused with a clear error rather than merged.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from keepstate.db import schema
from keepstate.db.engine import Conn, Database
from keepstate.errors import KeepStateError

log = logging.getLogger("keepstate.db")

CATALOG, SESSIONS, GATEWAY = "catalog.sqlite", "sessions.sqlite", "gateway.sqlite"
FILES = (CATALOG, SESSIONS, GATEWAY)
SUFFIX = ".imported"
SECRETS_KEY_META = "secrets_key_fingerprint"  # the catalog's meta key of the secrets key's fingerprint

# Each file's tables copied column for column (those the new table also has); snapshots and meta are special.
_TABLES = {
    CATALOG: ("api_keys", "sandboxes", "templates", "template_builds", "template_tags", "template_layers",
              "volumes", "secrets", "secret_versions", "teardowns"),
    SESSIONS: ("events", "heads", "sessions", "checkpoints"),
    GATEWAY: ("runs", "bindings", "marks", "positions", "calls", "divergences", "ledger", "budgets",
              "reservations"),
}
# What tells that a file's rows are in the database already: (file, table, key column).
_WITNESSES = ((CATALOG, "api_keys", "id"), (CATALOG, "sandboxes", "sandbox_id"),
              (SESSIONS, "sessions", "session_id"), (GATEWAY, "runs", "run_id"))
BATCH = 500


class LegacyImportRefused(KeepStateError):
    """The data directory holds files of an older release whose rows the database does not have, and the
    database holds other data: merging the two is not something to do silently."""


def legacy_files(home: Path) -> list[Path]:
    """The files of an older release in `home` that are still to import."""
    return [home / name for name in FILES if (home / name).is_file()]


async def import_home(db: Database, home: Path, node_id: str) -> dict[str, int] | None:
    """Import the older release's files in `home` into `db` (see the module's docstring); the rows copied per
    table, or None when there was nothing to import."""
    files = legacy_files(home)
    if not files:
        return None
    async with db.transaction() as conn:
        if not await _empty(conn):
            if await _imported_already(conn, files):
                log.info("the files %s were imported before; renaming them", ", ".join(p.name for p in files))
                _rename(files)
                return None
            raise LegacyImportRefused(
                f"{home} holds {', '.join(p.name for p in files)} of an older release, and the database "
                f"{db.url.shown} holds other data: start with an empty database to import them, or move the "
                "files away to start without them")
        counts: dict[str, int] = {}
        for path in files:
            with closing(_open(path)) as old:
                for table in _TABLES[path.name]:
                    counts[table] = await _copy(conn, old, table, node_id)
                if path.name == CATALOG:
                    counts["snapshots"] = await _copy_snapshots(conn, old)
                    await _copy_secrets_key(conn, old)
        if db.kind == "postgresql":
            await _advance_sequences(conn)
    _rename(files)
    log.info("imported %s into %s: %s", ", ".join(p.name for p in files), db.url.shown,
             ", ".join(f"{n} {t}" for t, n in counts.items() if n))
    return counts


def _open(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=30)  # read, never written (a read-only open could not use its WAL)
    conn.row_factory = sqlite3.Row
    return conn


def _rows(old: sqlite3.Connection, table: str) -> Iterator[dict[str, Any]]:
    known = old.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (table,)).fetchone()
    if known is None:
        return
    for row in old.execute(f'SELECT * FROM "{table}"'):  # noqa: S608 - `table` is one of _TABLES' names
        yield dict(row)


async def _copy(conn: Conn, old: sqlite3.Connection, table_name: str, node_id: str) -> int:
    table = schema.metadata.tables[table_name]
    wanted = set(table.c.keys())
    batch: list[dict[str, Any]] = []
    count = 0
    for row in _rows(old, table_name):
        values = {k: v for k, v in row.items() if k in wanted}
        if table_name in ("sandboxes", "teardowns"):  # this server's, as the host's instances are
            values["node_id"] = node_id
        batch.append(values)
        if len(batch) >= BATCH:
            count += await _insert(conn, table, batch)
            batch = []
    return count + await _insert(conn, table, batch)


async def _insert(conn: Conn, table: sa.Table, batch: list[dict[str, Any]]) -> int:
    if not batch:
        return 0
    columns = sorted({k for values in batch for k in values})
    await conn.execute(table.insert(), [{k: values.get(k) for k in columns} for values in batch])
    return len(batch)


async def _copy_snapshots(conn: Conn, old: sqlite3.Connection) -> int:
    count = 0
    for row in _rows(old, "snapshots"):
        names = json.loads(row.pop("names") or "[]")
        await conn.execute(schema.snapshots.insert().values(**row))
        if names:
            await conn.execute(schema.snapshot_names.insert(),
                               [{"name": n, "snapshot_id": row["snapshot_id"]} for n in dict.fromkeys(names)])
        count += 1
    return count


async def _copy_secrets_key(conn: Conn, old: sqlite3.Connection) -> None:
    known = old.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'").fetchone()
    found = old.execute("SELECT v FROM meta WHERE k=?", (SECRETS_KEY_META,)).fetchone() if known else None
    if found is not None:
        await conn.execute(schema.secrets_key.insert().values(id=1, fingerprint=found[0]))


async def _advance_sequences(conn: Conn) -> None:
    """PostgreSQL's serial columns do not move on an explicit insert: set each to the largest value copied."""
    for table in schema.metadata.sorted_tables:
        for col in table.c:
            if col.primary_key and col.autoincrement is True:
                await conn.execute(sa.text(
                    f"SELECT setval(pg_get_serial_sequence('{table.name}', '{col.name}'), "
                    f"COALESCE((SELECT MAX({col.name}) FROM {table.name}), 0) + 1, false)"))


async def _empty(conn: Conn) -> bool:
    for file_tables in _TABLES.values():
        for name in file_tables:
            table = schema.metadata.tables[name]
            if (await conn.execute(sa.select(sa.literal(1)).select_from(table).limit(1))).first() is not None:
                return False
    return True


async def _imported_already(conn: Conn, files: list[Path]) -> bool:
    """Whether every witness row of the files is in the database (and at least one file has one)."""
    seen = 0
    for path in files:
        with closing(_open(path)) as old:
            for name, table_name, column in _WITNESSES:
                if name != path.name:
                    continue
                keys = [row[column] for row in _rows(old, table_name)]
                if not keys:
                    continue
                table = schema.metadata.tables[table_name]
                found = (await conn.execute(sa.select(sa.func.count()).select_from(table)
                                            .where(table.c[column].in_(keys)))).scalar_one()
                if found != len(set(keys)):
                    return False
                seen += 1
    return seen > 0


def _rename(files: list[Path]) -> None:
    for path in files:
        for extra in ("-wal", "-shm"):  # the WAL was read through the connection: nothing in it is lost
            sidecar = path.with_name(path.name + extra)
            if sidecar.exists():
                sidecar.rename(sidecar.with_name(sidecar.name.replace(extra, SUFFIX + extra)))
        path.rename(path.with_name(path.name + SUFFIX))
