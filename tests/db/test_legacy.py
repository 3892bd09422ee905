"""The upgrade in place (keepstate/db/legacy.py) of a data directory the release before the one database wrote
(tests/db/legacy/home, made by tests/db/legacy/make_home.py with that release's code): every row kept, every chain
still verifying, the files renamed once imported, on SQLite (at start) and PostgreSQL (explicitly)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import sqlalchemy as sa

from keepstate.apikeys import find
from keepstate.db import legacy, schema
from keepstate.db.engine import Database
from keepstate.db.repos import Keys, Snapshots, Templates, Volumes
from keepstate.db.setup import prepare
from keepstate.secret import SecretStore
from keepstate.secret.crypto import Sealer
from keepstate.session.chain import StoredEvent, verify_chain

LEGACY = Path(__file__).parent / "legacy" / "home"
KEY = bytes(range(32))  # make_home.py's secrets key
FILES = ("catalog.sqlite", "sessions.sqlite", "gateway.sqlite")


@pytest.fixture
def home(tmp_path: Path) -> Path:
    out = tmp_path / "home"
    shutil.copytree(LEGACY, out)
    return out


async def _count(db: Database, table: sa.Table) -> int:
    async with db.read() as conn:
        return int((await conn.execute(sa.select(sa.func.count()).select_from(table))).scalar_one())


async def _check_imported(db: Database, home: Path) -> None:
    """Every row make_home.py wrote, found through the repositories and checks of this release."""
    for name in FILES:
        assert not (home / name).exists() and (home / (name + legacy.SUFFIX)).is_file()
    keys = Keys(db)
    found = await find(keys, "e2b_" + "ab" * 20)
    assert found is not None and found.name == "legacy" and found.max_sandboxes == 3
    assert await find(keys, "e2b_" + "cd" * 20) is None  # revoked stays revoked
    assert len(await keys.list()) == 2
    async with db.read() as conn:
        rows = {r.sandbox_id: r for r in await conn.execute(sa.select(schema.sandboxes))}
    assert set(rows) == {"sbrunning", "sbpaused"}
    assert rows["sbrunning"].slot == 7 and rows["sbrunning"].node_id == "local" and rows["sbrunning"].version == 0
    assert '"ks-0002"' in rows["sbpaused"].doc  # the standby travels in the document as it was
    snap = await Snapshots(db).by_name("other-name")
    assert snap is not None and snap.snapshot_id == "snapshot-cp1" and snap.names == ("my-snap", "other-name")
    vol = await Volumes(db).by_name("data")
    assert vol is not None and vol.token == "voltoken" and vol.size_mb == 64
    secrets = SecretStore(db, Sealer(KEY))
    await secrets.check_key()  # the fingerprint moved with them: the same key is accepted
    assert await secrets.value("api-token") == "s3cret-value-2"
    with pytest.raises(Exception, match="not the one"):
        await SecretStore(db, Sealer(bytes(32))).check_key()
    templates = Templates(db)
    tpl = await templates.get_template("my-template")
    assert tpl is not None and tpl.template_id == "tpl-1"
    assert await templates.tag_build("tpl-1", "v1") == "bld-1"
    layer = await templates.get_layer("build:bld-1")
    assert layer is not None and layer.checkpoint_id == "CP3" and layer.state["workdir"] == "/home/user"
    assert await _count(db, schema.teardowns) == 1
    # The histories: the same hashes, and each chain verifies against its head.
    async with db.read() as conn:
        for session in ("sbrunning", "sbpaused"):
            events = [StoredEvent(session, r.seq, r.ts, r.kind, r.data, r.prev, r.hash) for r in await conn.execute(
                sa.select(schema.events).where(schema.events.c.session_id == session).order_by(schema.events.c.seq))]
            head = (await conn.execute(sa.select(schema.heads.c.seq, schema.heads.c.hash)
                                       .where(schema.heads.c.session_id == session))).one()
            assert len(events) == 2 and verify_chain(session, events, (head.seq, head.hash)).ok
        cursor = (await conn.execute(sa.select(schema.heads.c.journal_cursor)
                                     .where(schema.heads.c.session_id == "sbrunning"))).scalar_one()
        assert cursor == 5
    assert await _count(db, schema.sessions) == 2 and await _count(db, schema.checkpoints) == 2
    # The ledger: the call billed once, the served answer, the budget's spending.
    assert await _count(db, schema.ledger) == 2 and await _count(db, schema.calls) == 1
    async with db.read() as conn:
        budget = (await conn.execute(sa.select(schema.budgets))).one()
    assert budget.spent_nano == 4200 and budget.reserved_nano == 0
    assert await _count(db, schema.bindings) == 1 and await _count(db, schema.marks) == 1


async def test_sqlite_home_is_imported_at_first_start(home: Path) -> None:
    db = await prepare(f"sqlite:///{home}/keepstate.sqlite", home)
    try:
        await _check_imported(db, home)
    finally:
        await db.close()
    again = await prepare(f"sqlite:///{home}/keepstate.sqlite", home)  # a second start imports nothing anew
    try:
        assert len(await Keys(again).list()) == 2
    finally:
        await again.close()


async def test_postgres_imports_explicitly(home: Path, postgres: object) -> None:
    from keepstate.testing.postgres import PostgresServer

    assert isinstance(postgres, PostgresServer)
    url = postgres.createdb("legacy_pg")
    db = await prepare(url, home)
    try:
        assert all((home / name).exists() for name in FILES)  # PostgreSQL never imports on its own
        counts = await legacy.import_home(db, home, "local")
        assert counts is not None and counts["events"] == 4 and counts["ledger"] == 2
        await _check_imported(db, home)
        # the serial columns moved past the copied rows: a new ledger entry or secret gets a new number
        secrets = SecretStore(db, Sealer(KEY))
        made = await secrets.create("another", "v")
        assert made.seq > 1
    finally:
        await db.close()


async def test_crash_between_commit_and_rename_is_recognised(home: Path, tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    shutil.copytree(home, kept)
    db = await prepare(f"sqlite:///{home}/keepstate.sqlite", home)
    try:
        for name in FILES:  # as if the server died after the commit, before renaming the files
            (home / (name + legacy.SUFFIX)).unlink()
            shutil.copy(kept / name, home / name)
        assert await legacy.import_home(db, home, "local") is None
        assert not any((home / name).exists() for name in FILES)
        assert len(await Keys(db).list()) == 2  # nothing twice
    finally:
        await db.close()


async def test_files_not_in_a_database_with_other_data_are_refused(home: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    db = await prepare(f"sqlite:///{other}/keepstate.sqlite", other)
    try:
        await Keys(db).create("someone", "hash", "e2b_0000")
        with pytest.raises(legacy.LegacyImportRefused, match="holds other data"):
            await legacy.import_home(db, home, "local")
        assert all((home / name).exists() for name in FILES)
    finally:
        await db.close()


async def test_a_failed_import_leaves_the_files_and_an_empty_database(home: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    db = await prepare(f"sqlite:///{home}/keepstate.sqlite", home.parent / "nowhere")  # start without importing
    try:
        async def crash(*args: object) -> None:  # the process dies half-way through the copy
            raise RuntimeError("killed mid-import")

        monkeypatch.setattr(legacy, "_copy_secrets_key", crash)
        with pytest.raises(RuntimeError, match="mid-import"):
            await legacy.import_home(db, home, "local")
        assert all((home / name).exists() for name in FILES)
        assert await _count(db, schema.api_keys) == 0 and await _count(db, schema.sandboxes) == 0
        monkeypatch.undo()
        assert await legacy.import_home(db, home, "local") is not None  # the next start imports it all
        await _check_imported(db, home)
    finally:
        await db.close()
