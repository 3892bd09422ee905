"""The secret store on a real SQLite catalog: values sealed (AES-256-GCM) and only `value()` opens them; a row
altered, moved to another secret or version, or read with another key fails clearly; versions, names, paging."""

from __future__ import annotations

import base64
import os
import sqlite3
import stat
from pathlib import Path

import pytest

from keepstate.db.catalog import SCHEMA, SCHEMA_VERSION, Catalog
from keepstate.errors import BadRequest, Conflict, NotFound
from keepstate.secret import SecretKeyError, SecretStore
from keepstate.secret.crypto import ENV_VAR, Sealer, load_key

VALUE = "sk-live-" + "7f3a9c" * 6


def open_store(tmp_path: Path, key_file: str = "secrets.key") -> SecretStore:
    return SecretStore.open(Catalog(tmp_path / "catalog.sqlite"), tmp_path / key_file)


@pytest.fixture(autouse=True)
def no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)


def on_disk(tmp_path: Path) -> bytes:
    """Every byte the catalog has on disk (the WAL too)."""
    return b"".join(p.read_bytes() for p in tmp_path.glob("catalog.sqlite*"))


def raw_db(tmp_path: Path) -> sqlite3.Connection:
    return sqlite3.connect(tmp_path / "catalog.sqlite", isolation_level=None)


def test_a_value_round_trips_sealed_and_only_value_opens_it(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    row = store.create("OpenAI-Key", VALUE, {"owner": "team-a"})
    assert row.secret_id.startswith("sec_") and row.name == "openai-key" and row.current_version == 1
    assert row.metadata == {"owner": "team-a"} and row.created_at == row.updated_at
    assert not any(VALUE in repr(getattr(row, f)) for f in row.__dataclass_fields__)
    assert store.value("openai-key") == VALUE and store.value("OPENAI-KEY") == VALUE
    assert store.value("missing") is None
    assert store.exists("OpenAI-key") and not store.exists("missing")
    assert VALUE.encode() not in on_disk(tmp_path)
    sealed = store.catalog.secret_sealed(row.secret_id, 1)
    assert sealed is not None and VALUE.encode() not in sealed and len(sealed) == 1 + 12 + len(VALUE) + 16
    key_file = tmp_path / "secrets.key"
    assert len(key_file.read_bytes()) == 32 and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    store.catalog.close()
    again = open_store(tmp_path)  # the same key file: the values open after a reopen
    assert again.value("openai-key") == VALUE


def test_a_tampered_ciphertext_does_not_open(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    row = store.create("k", VALUE)
    db = raw_db(tmp_path)
    sealed = bytearray(db.execute("SELECT sealed FROM secret_versions").fetchone()[0])
    sealed[20] ^= 0x01
    db.execute("UPDATE secret_versions SET sealed=?", (bytes(sealed),))
    with pytest.raises(SecretKeyError, match="does not decrypt") as err:
        store.value("k")
    assert row.secret_id in str(err.value) and VALUE not in str(err.value)
    db.execute("UPDATE secret_versions SET sealed=?", (b"\x01short",))
    with pytest.raises(SecretKeyError, match="malformed"):
        store.value("k")


def test_a_ciphertext_moved_to_another_secret_or_version_does_not_open(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    a, b = store.create("a", "value-of-a"), store.create("b", "value-of-b")
    db = raw_db(tmp_path)
    sealed_a = db.execute("SELECT sealed FROM secret_versions WHERE secret_id=?", (a.secret_id,)).fetchone()[0]
    db.execute("UPDATE secret_versions SET sealed=? WHERE secret_id=?", (sealed_a, b.secret_id))
    with pytest.raises(SecretKeyError, match=b.secret_id):
        store.value("b")
    assert store.value("a") == "value-of-a"
    # Version 1's ciphertext put in place of version 2's, of the same secret: refused too.
    store.update("a", "second-value")
    db.execute("UPDATE secret_versions SET sealed=? WHERE secret_id=? AND version=2", (sealed_a, a.secret_id))
    with pytest.raises(SecretKeyError, match="version 2"):
        store.value("a")


def test_another_key_is_refused_clearly(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    secret_id = store.create("k", VALUE).secret_id
    sealed = store.catalog.secret_sealed(secret_id, 1)
    store.catalog.close()
    (tmp_path / "other.key").write_bytes(os.urandom(32))
    (tmp_path / "other.key").chmod(0o600)
    with pytest.raises(SecretKeyError, match="not the one the 1 secret"):
        open_store(tmp_path, "other.key")
    # The sealer itself, given the wrong key: an error naming the secret, not a garbled value.
    assert sealed is not None
    with pytest.raises(SecretKeyError, match="sealed with another key"):
        Sealer(os.urandom(32)).open(secret_id, 1, sealed)


def test_a_new_key_is_taken_while_there_are_no_secrets(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.create("k", VALUE)
    assert store.delete("k")
    store.catalog.close()
    (tmp_path / "other.key").write_bytes(os.urandom(32))
    (tmp_path / "other.key").chmod(0o600)
    again = open_store(tmp_path, "other.key")
    again.create("k", VALUE)
    assert again.value("k") == VALUE


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


def test_updates_are_new_versions(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    first = store.create("k", "v1", {"a": "1"})
    second = store.update("K", "v2")  # by name, any case; metadata kept
    assert (second.secret_id, second.current_version, second.metadata) == (first.secret_id, 2, {"a": "1"})
    assert second.updated_at >= first.updated_at and second.created_at == first.created_at
    third = store.update(first.secret_id, "v3", {"b": "2"})  # by ID; metadata replaced
    assert (third.current_version, third.metadata) == (3, {"b": "2"})
    assert store.update(first.secret_id, "v4", {}).metadata == {}
    assert store.value("k") == "v4" and store.get("k").current_version == 4
    # Earlier versions stay sealed in the catalog, each under its own version number.
    sealer = store._sealer
    olds = [sealer.open(first.secret_id, v, store.catalog.secret_sealed(first.secret_id, v) or b"") for v in (1, 2, 3)]
    assert olds == ["v1", "v2", "v3"]
    with pytest.raises(NotFound):
        store.update("missing", "x")
    assert store.get("k").current_version == 4  # a refused update changed nothing
    with pytest.raises(BadRequest):
        store.update("k", "")
    assert store.get("k").current_version == 4


def test_names_are_case_insensitive_unique_and_checked(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    row = store.create("My.Key_1-x", VALUE)
    assert row.name == "my.key_1-x"
    assert store.get("MY.KEY_1-X").secret_id == row.secret_id == store.get(row.secret_id.upper()).secret_id
    with pytest.raises(Conflict, match="exists"):
        store.create("MY.key_1-X", "other")
    assert store.value("my.key_1-x") == VALUE  # the refused create changed nothing
    for bad in ("", "a b", "a\tb", "a{b", "a}b", "a\x00", "a\x7f", "a/b", "a?b", "a#b", "a%b", "a\\b", "..",
                "sec_x", "SEC_x", "x" * 129, None, 5):
        with pytest.raises(BadRequest):
            store.create(bad, VALUE)
    assert store.create("x" * 128, VALUE).name == "x" * 128
    assert store.catalog.count_secrets() == 2


def test_values_and_metadata_are_checked_without_quoting_the_value(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    for bad in ("", None, 3, "a" * (64 * 1024 + 1), "line\r\nX-Injected: 1", "nul\x00" + VALUE):
        with pytest.raises(BadRequest) as err:
            store.create("k", bad)
        assert VALUE not in err.value.message and "X-Injected" not in err.value.message
    assert store.create("big", "é" * (32 * 1024)).name == "big"  # 64 KiB of UTF-8 exactly
    for meta in ([], {"a": 1}, {"": "v"}, {f"k{i}": "v" for i in range(33)}, {"k" * 129: "v"}, {"k": "v" * 1025},
                 {f"k{i}": "v" * 1000 for i in range(9)}):
        with pytest.raises(BadRequest):
            store.create("m", VALUE, meta)
    assert store.create("m", VALUE, {f"k{i}": "v" * 250 for i in range(32)}).current_version == 1
    assert store.catalog.count_secrets() == 2


def test_list_pages_oldest_first(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    made = [store.create(f"s{i}", VALUE).secret_id for i in range(7)]
    store.delete("s3")
    seen, token, pages = [], None, 0
    while True:
        rows, token = store.list(3, token)
        seen += [r.secret_id for r in rows]
        pages += 1
        if token is None:
            break
    assert seen == [m for i, m in enumerate(made) if i != 3] and pages == 2
    rows, token = store.list(6)
    assert len(rows) == 6 and token is None  # exactly a page: no empty page after it
    for bad in ("abc", "-1", "1" * 30, "١"):
        with pytest.raises(BadRequest, match="nextToken"):
            store.list(3, bad)
    for limit in (0, 101):
        with pytest.raises(BadRequest, match="limit"):
            store.list(limit)


def test_delete_forgets_every_version(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    row = store.create("k", VALUE)
    store.update("k", "v2")
    assert store.delete(row.secret_id) and not store.delete("k") and not store.delete(row.secret_id)
    assert store.find("k") is None and store.value("k") is None and not store.exists("k")
    assert raw_db(tmp_path).execute("SELECT COUNT(*) FROM secret_versions").fetchone()[0] == 0
    assert store.create("k", "again").current_version == 1  # the name is free again


def test_a_version_2_catalog_gains_the_secrets_when_opened(tmp_path: Path) -> None:
    path = tmp_path / "catalog.sqlite"
    old = sqlite3.connect(path)  # the catalog as version 2 wrote it: no secrets tables
    old.executescript(SCHEMA)
    old.execute("INSERT INTO meta (k,v) VALUES ('schema_version','2')")
    old.commit()
    old.close()
    store = SecretStore.open(Catalog(path), tmp_path / "secrets.key")
    assert store.catalog.get_meta("schema_version") == str(SCHEMA_VERSION) == "4"
    store.create("k", VALUE)
    assert store.value("k") == VALUE
