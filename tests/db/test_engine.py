"""The Database: SQLite's settings and IMMEDIATE writes, conditional updates under a race on both databases, and
DatabaseUnavailable (503, Retry-After) when PostgreSQL goes away and comes back."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Update, select, text

from keepstate.db import migrate, schema
from keepstate.db.engine import Database
from keepstate.db.errors import DatabaseUnavailable
from keepstate.db.url import default_url
from keepstate.testing.postgres import PostgresServer

from .conftest import require_postgres

sandboxes = schema.sandboxes
HANG = 60.0  # seconds after which a call that should have answered is taken to hang


def _sandbox_row(sandbox_id: str) -> dict[str, object]:
    return {"sandbox_id": sandbox_id, "state": "running", "template_id": "base", "template_digest": "d",
            "runtime_name": "ks-1", "slot": 1, "address": "10.88.0.6", "access_token": "tok", "started_at": 1.0,
            "end_at": 301.0, "cpu": 2.0, "memory_mb": 512, "api_key_id": None, "doc": "{}", "node_id": "local"}


def _transition(sandbox_id: str, expect_version: int, to: str) -> Update:
    return (sandboxes.update()
            .where(sandboxes.c.sandbox_id == sandbox_id, sandboxes.c.version == expect_version,
                   sandboxes.c.epoch == 0)
            .values(state=to, version=sandboxes.c.version + 1))


async def test_sqlite_runs_in_wal_and_never_waits_for_a_lock_on_the_loop(tmp_path: Path) -> None:
    db = await Database.open(default_url(tmp_path))
    try:
        for conn_of in (db.read, db.transaction):
            async with conn_of() as conn:
                assert (await conn.execute(text("PRAGMA journal_mode"))).scalar() == "wal"
                assert (await conn.execute(text("PRAGMA synchronous"))).scalar() == 1  # NORMAL
                # statements run on the loop's thread: SQLite itself never waits (inline_sqlite.py)
                assert (await conn.execute(text("PRAGMA busy_timeout"))).scalar() == 0
    finally:
        await db.close()


async def test_a_write_waits_for_another_process_lock_without_stopping_the_loop(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process holds the write lock: a write transaction waits for it by awaiting (the loop runs other
    tasks meanwhile), goes ahead once it is released, and is refused as unavailable (503) if it is held too long."""

    from keepstate.db import engine

    db = await Database.open(default_url(tmp_path))
    other = sqlite3.connect(tmp_path / "keepstate.sqlite", timeout=0, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        running = asyncio.get_running_loop().create_task(ticker())

        async def write() -> None:
            async with db.transaction() as conn:
                await conn.execute(text("CREATE TABLE IF NOT EXISTS t (x INTEGER)"))

        waiting = asyncio.get_running_loop().create_task(write())
        await asyncio.sleep(0.3)
        assert not waiting.done() and ticks >= 10  # it waits, and the loop goes on
        other.execute("ROLLBACK")
        await asyncio.wait_for(waiting, 10)
        running.cancel()

        other.execute("BEGIN IMMEDIATE")
        monkeypatch.setattr(engine, "SQLITE_BUSY_TIMEOUT_MS", 300)
        short = await Database.open(default_url(tmp_path))  # a busy timeout of 0.3 s
        try:
            with pytest.raises(DatabaseUnavailable, match="locked"):
                async with short.transaction() as conn:
                    await conn.execute(text("SELECT 1"))
        finally:
            await short.close()
            other.execute("ROLLBACK")
    finally:
        other.close()
        await db.close()


async def test_sqlite_write_transactions_take_the_write_lock_at_begin(tmp_path: Path) -> None:
    """BEGIN IMMEDIATE: another writer is locked out from the first statement on, before anything is written."""
    db = await Database.open(default_url(tmp_path))
    other = sqlite3.connect(tmp_path / "keepstate.sqlite", timeout=0, isolation_level=None)
    try:
        async with db.transaction() as conn:
            await conn.execute(text("SELECT 1"))
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
        async with db.read() as conn:  # a read takes no write lock
            await conn.execute(text("SELECT 1"))
            other.execute("BEGIN IMMEDIATE")
            other.execute("ROLLBACK")
    finally:
        other.close()
        await db.close()


async def test_one_of_two_racing_conditional_updates_wins(database: Database) -> None:
    """Two servers move one sandbox row from version 0 at once: the second waits for the first's lock, then finds
    the row changed and updates nothing (the repository's `Stale`), never a silent overwrite."""
    async with database.transaction() as conn:
        await conn.execute(sandboxes.insert().values(**_sandbox_row("sb1")))
    second = await Database.open(database.url)
    first_updated = asyncio.Event()
    first_commits_at: list[float] = []
    second_done_at: list[float] = []

    async def first() -> int:
        async with database.transaction() as conn:
            n = (await conn.execute(_transition("sb1", 0, "pausing"))).rowcount
            first_updated.set()
            await asyncio.sleep(0.3)  # the second is waiting on the row (PostgreSQL) or the write lock (SQLite)
            first_commits_at.append(time.monotonic())
        return n

    async def other() -> int:
        await first_updated.wait()
        async with second.transaction() as conn:
            n = (await conn.execute(_transition("sb1", 0, "killing"))).rowcount
            second_done_at.append(time.monotonic())
        return n

    try:
        assert list(await asyncio.gather(first(), other())) == [1, 0]
        assert second_done_at[0] >= first_commits_at[0]  # it really waited for the first
        async with second.read() as conn:
            row = (await conn.execute(select(sandboxes.c.state, sandboxes.c.version))).one()
        assert tuple(row) == ("pausing", 1)
    finally:
        await second.close()


async def test_many_racing_conditional_updates_one_wins(database: Database) -> None:
    async with database.transaction() as conn:
        await conn.execute(sandboxes.insert().values(**_sandbox_row("sb2")))
    servers = [database] + [await Database.open(database.url) for _ in range(3)]

    async def move(db: Database, to: str) -> int:
        async with db.transaction() as conn:
            return int((await conn.execute(_transition("sb2", 0, to))).rowcount)

    try:
        won = await asyncio.gather(*(move(db, f"state-{i}") for i, db in enumerate(servers)))
        assert sorted(won) == [0, 0, 0, 1]
        async with database.read() as conn:
            row = (await conn.execute(select(sandboxes.c.state, sandboxes.c.version))).one()
        assert tuple(row) == (f"state-{won.index(1)}", 1)
    finally:
        for db in servers[1:]:
            await db.close()


def test_unavailable_is_a_503_that_says_retry() -> None:
    e = DatabaseUnavailable("postgresql://u:***@h/ks: connection refused")
    assert e.status == 503 and e.headers() == {"Retry-After": "2", "Should-Retry": "true"}
    assert e.body() == {"code": 503, "message": "the database is unavailable: postgresql://u:***@h/ks: connection "
                                                "refused"}


async def test_open_fails_when_the_server_is_unreachable(tmp_path: Path) -> None:
    with pytest.raises(DatabaseUnavailable) as refused:  # bounded: a hang fails the test instead of stalling it
        await asyncio.wait_for(Database.open(f"postgresql://ks:hunter2@/ks?host={tmp_path}/no-server-here"),
                               timeout=HANG)
    assert "postgresql://ks:***@/ks" in refused.value.message and "hunter2" not in refused.value.message


async def test_sqlite_file_that_cannot_be_made_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(DatabaseUnavailable, match="cannot make"):
        await Database.open(f"sqlite:///{tmp_path}/a-file/keepstate.sqlite")


async def test_unavailable_while_postgres_is_down_and_fine_once_it_is_back() -> None:
    require_postgres()
    pg = PostgresServer()
    await asyncio.to_thread(pg.start)
    try:
        db = await Database.open(await asyncio.to_thread(pg.createdb, "fault"))
        try:
            await migrate.upgrade(db)
            async with db.transaction() as conn:
                await conn.execute(sandboxes.insert().values(**_sandbox_row("before")))
            with pytest.raises(DatabaseUnavailable) as cut:
                async with db.transaction() as conn:  # the server stops in the middle of a transaction
                    await conn.execute(sandboxes.insert().values(**_sandbox_row("lost")))
                    await asyncio.to_thread(pg.shutdown)
                    await conn.execute(select(sandboxes.c.sandbox_id))
            assert cut.value.status == 503 and cut.value.headers()["Retry-After"] == "2"
            for conn_of in (db.read, db.transaction):  # while it is down: a 503, not a hang

                async def select_one(conn_of: Any = conn_of) -> None:
                    async with conn_of() as conn:
                        await conn.execute(text("SELECT 1"))

                with pytest.raises(DatabaseUnavailable):
                    await asyncio.wait_for(select_one(), timeout=HANG)
            await asyncio.to_thread(pg.restart)
            async with db.transaction() as conn:
                await conn.execute(sandboxes.insert().values(**_sandbox_row("after")))
            async with db.read() as conn:
                ids = (await conn.execute(select(sandboxes.c.sandbox_id).order_by(sandboxes.c.sandbox_id))).scalars()
                assert list(ids) == ["after", "before"]  # the cut transaction never committed
        finally:
            await db.close()
    finally:
        await asyncio.to_thread(pg.stop)


async def test_a_nul_in_text_is_refused_alike_on_both_databases(database: Database) -> None:
    """PostgreSQL's text cannot hold U+0000 (its DataError would be a 500); SQLite's can: both refuse it, before the
    statement runs, as bad input (400), whether it is written or only looked up. Bytes with a NUL pass."""
    import sqlalchemy as sa

    from keepstate.db.records import SecretRecord
    from keepstate.db.repos import Secrets, Volumes
    from keepstate.errors import BadRequest

    with pytest.raises(BadRequest, match="NUL"):
        await Volumes(database).by_name("a\x00b")
    with pytest.raises(BadRequest, match="NUL"):
        await Secrets(database).put(SecretRecord(secret_id="sec_1", name="n\x00", current_version=1, created_at=0,
                                                 updated_at=0), b"x")
    made = await Secrets(database).put(SecretRecord(secret_id="sec_2", name="n", current_version=1, created_at=0,
                                                    updated_at=0), b"\x00sealed\x00")
    assert await Secrets(database).sealed(made.secret_id, 1) == b"\x00sealed\x00"
    async with database.read() as conn:  # the database still answers afterwards
        assert (await conn.execute(sa.text("SELECT 1"))).scalar_one() == 1
