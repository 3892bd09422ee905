"""The secret store on a real database (SQLite and PostgreSQL): values sealed (AES-256-GCM) and only `value()`
opens them; a row altered, moved to another secret or version, or read with another key fails clearly; versions,
names, paging; the secrets of an older release's catalog.sqlite, imported, open with the same key."""

from __future__ import annotations

import base64
import os
import sqlite3
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from keepstate.db.engine import Database
from keepstate.db.legacy import import_home
from keepstate.db.schema import secret_versions, secrets, secrets_key
from keepstate.errors import BadRequest, Conflict, NotFound
from keepstate.secret import SecretKeyError, SecretStore
from keepstate.secret.crypto import ENV_VAR, Sealer, load_key
from keepstate.testing.databases import database, db_url, postgres  # noqa: F401

VALUE = "sk-live-" + "7f3a9c" * 6


@pytest.fixture
async def opened(database: Database) -> AsyncIterator[list[Database]]:  # noqa: F811
    """Every other Database a test opens on the test's database (`reopen`), closed after it."""
    dbs: list[Database] = []
    yield dbs
    for db in dbs:
        await db.close()


async def reopen(database: Database, opened: list[Database]) -> Database:  # noqa: F811
    """Another Database on the same database: what the server has after a restart."""
    db = await Database.open(database.url)
    opened.append(db)
    return db


async def open_store(db: Database, tmp_path: Path, key_file: str = "secrets.key") -> SecretStore:
    store = SecretStore.open(db, tmp_path / key_file)
    await store.check_key()
    return store


@pytest.fixture(autouse=True)
def no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)


async def stored(db: Database) -> bytes:
    """Every byte the database holds of the secrets: on SQLite every byte of its files (the WAL too), on both the
    rows of the secrets' tables."""
    found = b""
    if db.url.path is not None:
        found += b"".join(p.read_bytes() for p in db.url.path.parent.glob(db.url.path.name + "*"))
    async with db.read() as conn:
        for table in (secrets, secret_versions, secrets_key):
            for row in await conn.execute(sa.select(table)):
                found += b"".join(v if isinstance(v, bytes) else repr(v).encode() for v in row)
    return found


async def sealed_of(db: Database, secret_id: str | None = None, version: int | None = None) -> bytes:
    where = [c for c in (secret_versions.c.secret_id == secret_id if secret_id else None,
                         secret_versions.c.version == version if version else None) if c is not None]
    async with db.read() as conn:
        return bytes((await conn.execute(sa.select(secret_versions.c.sealed).where(*where))).scalar_one())


async def set_sealed(db: Database, sealed: bytes, secret_id: str | None = None, version: int | None = None) -> None:
    """Alter the stored ciphertext behind the store's back (what a tampered row is)."""
    where = [c for c in (secret_versions.c.secret_id == secret_id if secret_id else None,
                         secret_versions.c.version == version if version else None) if c is not None]
    async with db.transaction() as conn:
        assert (await conn.execute(secret_versions.update().where(*where).values(sealed=sealed))).rowcount >= 1


async def test_a_value_round_trips_sealed_and_only_value_opens_it(database: Database, opened: list[Database],  # noqa: F811
                                                                 tmp_path: Path) -> None:
    store = await open_store(database, tmp_path)
    row = await store.create("OpenAI-Key", VALUE, {"owner": "team-a"})
    assert row.secret_id.startswith("sec_") and row.name == "openai-key" and row.current_version == 1
    assert row.metadata == {"owner": "team-a"} and row.created_at == row.updated_at
    assert not any(VALUE in repr(getattr(row, f)) for f in row.__dataclass_fields__)
    assert await store.value("openai-key") == VALUE and await store.value("OPENAI-KEY") == VALUE
    assert await store.value("missing") is None
    assert await store.exists("OpenAI-key") and not await store.exists("missing")
    assert VALUE.encode() not in await stored(database)
    sealed = await store.repo.sealed(row.secret_id, 1)
    assert sealed is not None and VALUE.encode() not in sealed and len(sealed) == 1 + 12 + len(VALUE) + 16
    key_file = tmp_path / "secrets.key"
    assert len(key_file.read_bytes()) == 32 and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    again = await open_store(await reopen(database, opened), tmp_path)  # the same key file: the values open after
    assert await again.value("openai-key") == VALUE  # a restart


async def test_a_tampered_ciphertext_does_not_open(database: Database, tmp_path: Path) -> None:  # noqa: F811
    store = await open_store(database, tmp_path)
    row = await store.create("k", VALUE)
    sealed = bytearray(await sealed_of(database))
    sealed[20] ^= 0x01
    await set_sealed(database, bytes(sealed))
    with pytest.raises(SecretKeyError, match="does not decrypt") as err:
        await store.value("k")
    assert row.secret_id in str(err.value) and VALUE not in str(err.value)
    await set_sealed(database, b"\x01short")
    with pytest.raises(SecretKeyError, match="malformed"):
        await store.value("k")


async def test_a_ciphertext_moved_to_another_secret_or_version_does_not_open(database: Database,  # noqa: F811
                                                                             tmp_path: Path) -> None:
    store = await open_store(database, tmp_path)
    a, b = await store.create("a", "value-of-a"), await store.create("b", "value-of-b")
    sealed_a = await sealed_of(database, a.secret_id)
    await set_sealed(database, sealed_a, b.secret_id)
    with pytest.raises(SecretKeyError, match=b.secret_id):
        await store.value("b")
    assert await store.value("a") == "value-of-a"
    # Version 1's ciphertext put in place of version 2's, of the same secret: refused too.
    await store.update("a", "second-value")
    await set_sealed(database, sealed_a, a.secret_id, 2)
    with pytest.raises(SecretKeyError, match="version 2"):
        await store.value("a")


async def test_another_key_is_refused_clearly(database: Database, opened: list[Database],  # noqa: F811
                                              tmp_path: Path) -> None:
    store = await open_store(database, tmp_path)
    secret_id = (await store.create("k", VALUE)).secret_id
    sealed = await store.repo.sealed(secret_id, 1)
    (tmp_path / "other.key").write_bytes(os.urandom(32))
    (tmp_path / "other.key").chmod(0o600)
    with pytest.raises(SecretKeyError, match="not the one the 1 secret"):
        await open_store(await reopen(database, opened), tmp_path, "other.key")
    assert await (await open_store(database, tmp_path)).value("k") == VALUE  # the refusal changed nothing
    # The sealer itself, given the wrong key: an error naming the secret, not a garbled value.
    assert sealed is not None
    with pytest.raises(SecretKeyError, match="sealed with another key"):
        Sealer(os.urandom(32)).open(secret_id, 1, sealed)


async def test_a_new_key_is_taken_while_there_are_no_secrets(database: Database, opened: list[Database],  # noqa: F811
                                                             tmp_path: Path) -> None:
    store = await open_store(database, tmp_path)
    await store.create("k", VALUE)
    assert await store.delete("k")
    (tmp_path / "other.key").write_bytes(os.urandom(32))
    (tmp_path / "other.key").chmod(0o600)
    again = await open_store(await reopen(database, opened), tmp_path, "other.key")
    await again.create("k", VALUE)
    assert await again.value("k") == VALUE
    with pytest.raises(SecretKeyError, match="not the one the 1 secret"):  # the new key is the one now
        await open_store(database, tmp_path)


def test_the_key_from_the_environment_wins_and_leaves_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = os.urandom(32)
    monkeypatch.setenv(ENV_VAR, base64.b64encode(key).decode())
    assert load_key(tmp_path / "secrets.key") == key
    assert ENV_VAR not in os.environ  # no child process inherits it
    assert not (tmp_path / "secrets.key").exists()
    monkeypatch.setenv(ENV_VAR, "not base64!")
    with pytest.raises(SecretKeyError, match="not base64"):
        load_key(tmp_path / "secrets.key")
    monkeypatch.setenv(ENV_VAR, base64.b64encode(os.urandom(16)).decode())
    with pytest.raises(SecretKeyError, match="16 bytes"):
        load_key(tmp_path / "secrets.key")


def test_key_files_raw_or_base64_and_bad_ones(tmp_path: Path) -> None:
    key = os.urandom(32)
    (tmp_path / "b64.key").write_text(base64.b64encode(key).decode() + "\n")
    assert load_key(tmp_path / "b64.key") == key
    (tmp_path / "bad.key").write_bytes(b"\xff" * 7)
    with pytest.raises(SecretKeyError, match="holds 7 bytes"):
        load_key(tmp_path / "bad.key")
    made = load_key(tmp_path / "sub" / "new.key")
    assert len(made) == 32 and load_key(tmp_path / "sub" / "new.key") == made
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["new.key"]  # no temporary left behind


async def test_updates_are_new_versions(database: Database, tmp_path: Path) -> None:  # noqa: F811
    store = await open_store(database, tmp_path)
    first = await store.create("k", "v1", {"a": "1"})
    second = await store.update("K", "v2")  # by name, any case; metadata kept
    assert (second.secret_id, second.current_version, second.metadata) == (first.secret_id, 2, {"a": "1"})
    assert second.updated_at >= first.updated_at and second.created_at == first.created_at
    third = await store.update(first.secret_id, "v3", {"b": "2"})  # by ID; metadata replaced
    assert (third.current_version, third.metadata) == (3, {"b": "2"})
    assert (await store.update(first.secret_id, "v4", {})).metadata == {}
    assert await store.value("k") == "v4" and (await store.get("k")).current_version == 4
    # Earlier versions stay sealed in the database, each under its own version number.
    sealer = store._sealer
    olds = [sealer.open(first.secret_id, v, await store.repo.sealed(first.secret_id, v) or b"") for v in (1, 2, 3)]
    assert olds == ["v1", "v2", "v3"]
    with pytest.raises(NotFound):
        await store.update("missing", "x")
    assert (await store.get("k")).current_version == 4  # a refused update changed nothing
    with pytest.raises(BadRequest):
        await store.update("k", "")
    assert (await store.get("k")).current_version == 4


async def test_names_are_case_insensitive_unique_and_checked(database: Database, tmp_path: Path) -> None:  # noqa: F811
    store = await open_store(database, tmp_path)
    row = await store.create("My.Key_1-x", VALUE)
    assert row.name == "my.key_1-x"
    by_id = await store.get(row.secret_id.upper())
    assert (await store.get("MY.KEY_1-X")).secret_id == row.secret_id == by_id.secret_id
    with pytest.raises(Conflict, match="exists"):
        await store.create("MY.key_1-X", "other")
    assert await store.value("my.key_1-x") == VALUE  # the refused create changed nothing
    for bad in ("", "a b", "a\tb", "a{b", "a}b", "a\x00", "a\x7f", "a/b", "a?b", "a#b", "a%b", "a\\b", "..",
                "sec_x", "SEC_x", "x" * 129, None, 5):
        with pytest.raises(BadRequest):
            await store.create(bad, VALUE)
    assert (await store.create("x" * 128, VALUE)).name == "x" * 128
    assert await store.repo.count() == 2


async def test_values_and_metadata_are_checked_without_quoting_the_value(database: Database,  # noqa: F811
                                                                         tmp_path: Path) -> None:
    store = await open_store(database, tmp_path)
    for bad in ("", None, 3, "a" * (64 * 1024 + 1), "line\r\nX-Injected: 1", "nul\x00" + VALUE):
        with pytest.raises(BadRequest) as err:
            await store.create("k", bad)
        assert VALUE not in err.value.message and "X-Injected" not in err.value.message
    assert (await store.create("big", "é" * (32 * 1024))).name == "big"  # 64 KiB of UTF-8 exactly
    for meta in ([], {"a": 1}, {"": "v"}, {f"k{i}": "v" for i in range(33)}, {"k" * 129: "v"}, {"k": "v" * 1025},
                 {f"k{i}": "v" * 1000 for i in range(9)}):
        with pytest.raises(BadRequest):
            await store.create("m", VALUE, meta)
    assert (await store.create("m", VALUE, {f"k{i}": "v" * 250 for i in range(32)})).current_version == 1
    assert await store.repo.count() == 2


async def test_list_pages_oldest_first(database: Database, tmp_path: Path) -> None:  # noqa: F811
    store = await open_store(database, tmp_path)
    made = [(await store.create(f"s{i}", VALUE)).secret_id for i in range(7)]
    await store.delete("s3")
    seen, token, pages = [], None, 0
    while True:
        rows, token = await store.list(3, token)
        seen += [r.secret_id for r in rows]
        pages += 1
        if token is None:
            break
    assert seen == [m for i, m in enumerate(made) if i != 3] and pages == 2
    rows, token = await store.list(6)
    assert len(rows) == 6 and token is None  # exactly a page: no empty page after it
    for bad in ("abc", "-1", "1" * 30, "١"):
        with pytest.raises(BadRequest, match="nextToken"):
            await store.list(3, bad)
    for limit in (0, 101):
        with pytest.raises(BadRequest, match="limit"):
            await store.list(limit)


async def test_delete_forgets_every_version(database: Database, tmp_path: Path) -> None:  # noqa: F811
    store = await open_store(database, tmp_path)
    row = await store.create("k", VALUE)
    await store.update("k", "v2")
    assert await store.delete(row.secret_id) and not await store.delete("k") and not await store.delete(row.secret_id)
    assert await store.find("k") is None and await store.value("k") is None and not await store.exists("k")
    async with database.read() as conn:
        assert (await conn.execute(sa.select(sa.func.count()).select_from(secret_versions))).scalar_one() == 0
    assert (await store.create("k", "again")).current_version == 1  # the name is free again


# The catalog.sqlite of the releases before the one database, as far as secrets go (its schema version 3 and 4).
OLD_CATALOG = """
CREATE TABLE meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE secrets (seq INTEGER PRIMARY KEY AUTOINCREMENT, secret_id TEXT NOT NULL UNIQUE, name TEXT NOT NULL UNIQUE,
    current_version INTEGER NOT NULL, metadata TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE secret_versions (secret_id TEXT NOT NULL, version INTEGER NOT NULL, sealed BLOB NOT NULL,
    created_at REAL NOT NULL, PRIMARY KEY (secret_id, version));
INSERT INTO meta (k, v) VALUES ('schema_version', '4');
"""


async def test_the_secrets_of_an_older_releases_catalog_open_once_imported(database: Database,  # noqa: F811
                                                                          opened: list[Database],
                                                                          tmp_path: Path) -> None:
    """An older release kept the secrets in catalog.sqlite and its key's fingerprint in the catalog's `meta`: once
    imported (keepstate.db.legacy), every version opens with the same key, the same key is the only one taken,
    and new secrets list after the imported ones."""
    home = tmp_path / "home-old"
    home.mkdir()
    sealer = Sealer(load_key(tmp_path / "secrets.key"))
    old = sqlite3.connect(home / "catalog.sqlite")
    old.executescript(OLD_CATALOG)
    old.execute("INSERT INTO meta (k, v) VALUES ('secrets_key_fingerprint', ?)", (sealer.fingerprint,))
    old.execute("INSERT INTO secrets VALUES (1, 'sec_a', 'a', 2, '{\"o\": \"x\"}', 1.0, 2.0)")
    old.execute("INSERT INTO secrets VALUES (5, 'sec_b', 'b', 1, '{}', 3.0, 3.0)")
    old.executemany("INSERT INTO secret_versions VALUES (?, ?, ?, ?)",
                    [("sec_a", 1, sealer.seal("sec_a", 1, "a-one"), 1.0),
                     ("sec_a", 2, sealer.seal("sec_a", 2, "a-two"), 2.0),
                     ("sec_b", 1, sealer.seal("sec_b", 1, VALUE), 3.0)])
    old.commit()
    old.close()

    counts = await import_home(database, home, "local")
    assert counts is not None and (counts["secrets"], counts["secret_versions"]) == (2, 3)
    assert not (home / "catalog.sqlite").exists() and (home / "catalog.sqlite.imported").exists()
    (tmp_path / "other.key").write_bytes(os.urandom(32))
    (tmp_path / "other.key").chmod(0o600)
    with pytest.raises(SecretKeyError, match="not the one the 2 secret"):  # the fingerprint came along
        await open_store(database, tmp_path, "other.key")

    store = await open_store(await reopen(database, opened), tmp_path)
    assert await store.value("a") == "a-two" and await store.value("B") == VALUE
    a = await store.get("a")
    assert (a.secret_id, a.current_version, a.metadata, a.created_at, a.updated_at) == ("sec_a", 2, {"o": "x"}, 1.0,
                                                                                        2.0)
    assert store._sealer.open("sec_a", 1, await store.repo.sealed("sec_a", 1) or b"") == "a-one"
    assert (await store.update("a", "a-three")).current_version == 3 and await store.value("a") == "a-three"
    c = await store.create("c", "new")
    assert c.seq > 5  # after the imported ones (PostgreSQL's sequence moved past the copied values)
    rows, _ = await store.list(10)
    assert [r.name for r in rows] == ["a", "b", "c"]
