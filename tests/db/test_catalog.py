"""The catalog keeps keys hashed and sandboxes across reopen (what re-adoption relies on)."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest

from keepstate.db.catalog import API_KEY_FORMAT, Catalog, SandboxRow
from keepstate.sandbox.record import Instance, Settings
from keepstate.sandbox.state import State


def test_keys_and_sandboxes_survive_reopen(tmp_path: Path) -> None:
    cat = Catalog(tmp_path / "c.sqlite")
    key, secret = cat.create_key("ci")
    assert cat.find_key(secret).id == key.id and cat.find_key("nope") is None
    raw = (tmp_path / "c.sqlite").read_bytes()
    assert secret.encode() not in raw  # only hashes are stored
    row = SandboxRow("pool-1", "pooled", "base", "d", "ks-1", 3, "10.88.0.14", "", 1.0, 1.0, 2, 512)
    cat.put_sandbox(row)
    claimed = SandboxRow("abc", "running", "base", "d", "ks-1", 3, "10.88.0.14", "tok", 2.0, 302.0, 2, 512,
                         settings=Settings(session_id="abc", metadata={"a": "b"},
                                           standby=Instance("ks-2", 4, "x", 5.0, 7)))
    cat.rename_sandbox("pool-1", claimed)
    cat.close()
    again = Catalog(tmp_path / "c.sqlite")
    assert again.get_sandbox("pool-1") is None
    got = again.get_sandbox("abc")
    assert got is not None and got.settings == claimed.settings and got.runtime_name == "ks-1"
    assert got.state is State.RUNNING
    assert again.revoke_key(key.id) and again.find_key(secret) is None
    again.put_snapshot("s1", ["n"], "CK", "abc", "base")
    assert again.get_snapshot("s1")["names"] == ["n"] and again.delete_snapshot("s1")


def test_rows_written_by_earlier_releases_still_load(tmp_path: Path) -> None:
    """Before typed settings, a row's `doc` was a dict with camelCase and snake_case keys; those rows load."""
    cat = Catalog(tmp_path / "c.sqlite")
    cat.put_sandbox(SandboxRow("old", "paused", "base", "d", "", -1, "", "tok", 1.0, 1.0, 2, 512))
    old_doc = {"metadata": {"k": "v"}, "envVars": {"A": "1"}, "templateEnv": {}, "autoPause": True,
               "allowInternetAccess": False, "user": "user", "workdir": "/home/user", "session_id": "old",
               "gateway": True, "gatewayToken": "gt", "checkpoint_id": "CK1",
               "standby": {"name": "ks-9", "slot": 9, "address": "10.88.0.38", "since": 3.0, "mem": 1024}}
    db = sqlite3.connect(tmp_path / "c.sqlite")
    db.execute("UPDATE sandboxes SET doc=? WHERE sandbox_id='old'", (json.dumps(old_doc),))
    db.commit()
    db.close()
    got = Catalog(tmp_path / "c.sqlite").get_sandbox("old")
    assert got is not None
    s = got.settings
    assert (s.metadata, s.env_vars, s.auto_pause, s.allow_internet_access) == ({"k": "v"}, {"A": "1"}, True, False)
    assert (s.gateway_token, s.checkpoint_id, s.session_id) == ("gt", "CK1", "old")
    assert s.standby == Instance("ks-9", 9, "10.88.0.38", 3.0, 1024) and s.retired is None


def test_keys_are_issued_in_e2bs_format_and_older_ones_still_work(tmp_path: Path) -> None:
    """e2b 2.45 refuses a key that is not "e2b_" + hex before it sends anything; keys we issued before in our own
    "ks_" format keep working."""
    cat = Catalog(tmp_path / "c.sqlite")
    key, secret = cat.create_key("new")
    assert re.fullmatch(r"e2b_[0-9a-f]+", secret) and API_KEY_FORMAT.match(secret) and key.prefix == secret[:8]
    old_key, old_secret = cat.create_key("old", key="ks_" + "ab" * 20)
    assert cat.find_key(old_secret).id == old_key.id and not API_KEY_FORMAT.match(old_secret)


def test_volumes_survive_reopen_and_names_are_unique(tmp_path: Path) -> None:
    from keepstate.errors import Conflict
    from keepstate.volume import VolumeRecord

    cat = Catalog(tmp_path / "c.sqlite")
    a = VolumeRecord("vola", "data", "vol_t1", 64, 1.0)
    cat.put_volume(a)
    cat.put_volume(VolumeRecord("volb", "other", "vol_t2", 16, 2.0))
    try:
        cat.put_volume(VolumeRecord("volc", "data", "vol_t3", 16, 3.0))
        raise AssertionError("a second volume named 'data' was accepted")
    except Conflict as exc:
        assert "data" in str(exc)
    cat.close()
    again = Catalog(tmp_path / "c.sqlite")
    assert again.get_volume("vola") == a and again.volume_by_name("data") == a
    assert [v.volume_id for v in again.volumes()] == ["vola", "volb"]
    assert again.delete_volume("vola") and not again.delete_volume("vola") and again.get_volume("vola") is None


def test_sandbox_rows_keep_their_volume_mounts(tmp_path: Path) -> None:
    cat = Catalog(tmp_path / "c.sqlite")
    mounts = [{"name": "data", "path": "/mnt/data", "volume_id": "vola"}]
    cat.put_sandbox(SandboxRow("s", "running", "base", "d", "ks-1", 1, "a", "t", 1.0, 2.0, 1, 512,
                               settings=Settings(volume_mounts=mounts)))
    got = cat.get_sandbox("s")
    assert got is not None and got.settings.volume_mounts == mounts
    assert Settings.from_json({"metadata": {}}).volume_mounts == []  # rows from before volumes load


def test_a_version_1_catalog_gains_the_keys_limit_when_opened(tmp_path: Path) -> None:
    from keepstate.db.catalog import SCHEMA, SCHEMA_VERSION, CatalogError, hash_key

    path = tmp_path / "old.sqlite"
    old = sqlite3.connect(path)  # the catalog as releases before the limits wrote it: no version, no column
    old.executescript(SCHEMA.replace(",\n    max_sandboxes INTEGER", ""))
    old.execute("INSERT INTO api_keys (id,name,key_hash,prefix,created_at) VALUES ('key_1','ci',?,'e2b_0000',1.0)",
                (hash_key("e2b_0000"),))
    old.commit()
    old.close()
    cat = Catalog(path)
    key = cat.find_key("e2b_0000")
    assert key is not None and key.name == "ci" and key.max_sandboxes is None
    assert cat.set_key_limit("key_1", 5) and cat.get_key("key_1").max_sandboxes == 5  # type: ignore[union-attr]
    assert cat.get_meta("schema_version") == str(SCHEMA_VERSION)
    cat.close()
    again = Catalog(path)  # opening it again changes nothing
    assert again.get_key("key_1").max_sandboxes == 5  # type: ignore[union-attr]
    again.set_meta("schema_version", str(SCHEMA_VERSION + 1))
    again.close()
    with pytest.raises(CatalogError, match="newer keepstate"):
        Catalog(path)
