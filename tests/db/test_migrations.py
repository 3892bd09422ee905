"""`upgrade head` on both databases: it creates exactly keepstate.db.schema, runs once however many start it, and
refuses a database written by a newer release."""

from __future__ import annotations

import asyncio

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import func, inspect, select, text
from sqlalchemy.engine import Connection

from keepstate.db import migrate, schema
from keepstate.db.engine import Database
from keepstate.db.errors import SchemaTooNew


def _tables(conn: Connection) -> set[str]:
    return set(inspect(conn).get_table_names())


def _differences(conn: Connection) -> list[object]:
    context = MigrationContext.configure(conn, opts={"compare_server_default": True})
    return list(compare_metadata(context, schema.metadata))


async def _versions(db: Database) -> list[str]:
    async with db.read() as conn:
        return list((await conn.execute(text("SELECT version_num FROM alembic_version"))).scalars())


def test_this_release_knows_one_revision() -> None:
    assert migrate.head() == "0004"


async def test_upgrade_creates_every_table_of_the_schema(database: Database) -> None:
    async with database.read() as conn:
        tables = await conn.run_sync(_tables)
        differences = await conn.run_sync(_differences)
    assert tables == set(schema.metadata.tables) | {"alembic_version"}
    assert len(schema.metadata.tables) == 29 and not {"meta"} & tables
    assert differences == []  # the revisions, written out by hand, create what schema.py describes
    assert await migrate.current(database) == ("0004",)


async def test_a_second_upgrade_changes_nothing(database: Database) -> None:
    async with database.transaction() as conn:
        await conn.execute(schema.volumes.insert().values(volume_id="v1", name="data", token="t", size_mb=1,
                                                          created_at=1.0))
    assert await migrate.upgrade(database) == "0004"
    assert await _versions(database) == ["0004"]
    async with database.read() as conn:
        assert (await conn.execute(select(schema.volumes.c.name))).scalars().all() == ["data"]


async def test_concurrent_upgrades_of_one_database_upgrade_it_once(db_url: str) -> None:
    servers = [await Database.open(db_url) for _ in range(3)]  # three servers starting at once on one database
    try:
        done = await asyncio.gather(*(migrate.upgrade(db) for db in servers))
        assert done == ["0004"] * 3
        assert await _versions(servers[0]) == ["0004"]
        async with servers[1].read() as conn:
            assert await conn.run_sync(_tables) == set(schema.metadata.tables) | {"alembic_version"}
            assert await conn.scalar(select(func.count()).select_from(schema.sandboxes)) == 0
    finally:
        for db in servers:
            await db.close()


async def test_a_database_of_a_newer_release_is_refused(db_url: str) -> None:
    db = await Database.open(db_url)
    try:
        await migrate.upgrade(db)
        async with db.transaction() as conn:
            await conn.execute(text("UPDATE alembic_version SET version_num = '0042_from_the_future'"))
    finally:
        await db.close()
    again = await Database.open(db_url)  # the older release starting on it
    try:
        with pytest.raises(SchemaTooNew) as refused:
            await migrate.upgrade(again)
        assert refused.value.message == ("the database is at revision 0042_from_the_future, newer than this release "
                                         "(0004): upgrade keepstate")
        assert await _versions(again) == ["0042_from_the_future"]  # untouched
    finally:
        await again.close()


async def test_a_database_at_0001_upgrades_in_place_keeping_its_teardowns(db_url: str) -> None:
    """The release before nodes wrote revision 0001: its teardowns are the one server's (`local`) after 0002."""
    from alembic import command

    db = await Database.open(db_url)
    try:
        async with db.transaction() as conn:
            await conn.run_sync(lambda c: command.upgrade(migrate.alembic_config(c), "0001"))
            await conn.execute(text("INSERT INTO teardowns (runtime_name, slot, attempts, next_try, last_error, "
                                    "created_at) VALUES ('ks-old', 3, 1, 0, 'x', 1)"))
        assert await migrate.upgrade(db) == "0004"
        async with db.read() as conn:
            rows = (await conn.execute(select(schema.teardowns.c.runtime_name, schema.teardowns.c.node_id))).all()
            assert [tuple(r) for r in rows] == [("ks-old", "local")]
            assert await conn.run_sync(_differences) == []
    finally:
        await db.close()
