"""The import (keepstate/db/legacy.py) of a catalog.sqlite written by releases older than the last before the one
database: its schema versions 1 (no keys' limit, no secrets, no templates, no teardowns) and 3 (no templates).
A column or a table the old file lacks is left to the new schema, so what the old catalog's own upgrade steps
added is there, and usable, once imported. (The last release's files, every table full: test_legacy.py.)"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from keepstate.apikeys import find, hash_key, issue
from keepstate.db.engine import Database
from keepstate.db.legacy import import_home
from keepstate.db.repos import Keys, Snapshots, Templates
from keepstate.sandbox.record import Instance, Settings
from keepstate.sandbox.rows import SandboxRows
from keepstate.sandbox.state import State

# The catalog's tables as its schema version 1 created them (keepstate/db/catalog.py of those releases).
VERSION_1 = """
CREATE TABLE api_keys (id TEXT PRIMARY KEY, name TEXT NOT NULL, key_hash TEXT NOT NULL UNIQUE, prefix TEXT NOT NULL,
    created_at REAL NOT NULL, revoked_at REAL);
CREATE TABLE sandboxes (sandbox_id TEXT PRIMARY KEY, state TEXT NOT NULL, template_id TEXT NOT NULL,
    template_digest TEXT NOT NULL, runtime_name TEXT NOT NULL, slot INTEGER NOT NULL, address TEXT NOT NULL,
    access_token TEXT NOT NULL, started_at REAL NOT NULL, end_at REAL NOT NULL, cpu REAL NOT NULL,
    memory_mb INTEGER NOT NULL, api_key_id TEXT, doc TEXT NOT NULL);
CREATE INDEX sandboxes_state ON sandboxes(state);
CREATE TABLE meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE snapshots (snapshot_id TEXT PRIMARY KEY, names TEXT NOT NULL, checkpoint_id TEXT NOT NULL,
    sandbox_id TEXT NOT NULL, template_id TEXT NOT NULL, created_at REAL NOT NULL);
"""
# What versions 2 and 3 added: the keys' limit, then the secrets.
VERSION_3 = VERSION_1.replace("revoked_at REAL)", "revoked_at REAL, max_sandboxes INTEGER)") + """
CREATE TABLE volumes (volume_id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, token TEXT NOT NULL,
    size_mb INTEGER NOT NULL, created_at REAL NOT NULL);
CREATE TABLE secrets (seq INTEGER PRIMARY KEY AUTOINCREMENT, secret_id TEXT NOT NULL UNIQUE, name TEXT NOT NULL UNIQUE,
    current_version INTEGER NOT NULL, metadata TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE secret_versions (secret_id TEXT NOT NULL, version INTEGER NOT NULL, sealed BLOB NOT NULL,
    created_at REAL NOT NULL, PRIMARY KEY (secret_id, version));
INSERT INTO meta (k, v) VALUES ('schema_version', '3');
"""

# A row's `doc` as releases before the typed settings wrote it: camelCase and snake_case keys, a standby as a dict.
OLD_DOC = {"metadata": {"k": "v"}, "envVars": {"A": "1"}, "templateEnv": {}, "autoPause": True,
           "allowInternetAccess": False, "user": "user", "workdir": "/home/user", "session_id": "old",
           "gateway": True, "gatewayToken": "gt", "checkpoint_id": "CK1",
           "standby": {"name": "ks-9", "slot": 9, "address": "10.88.0.38", "since": 3.0, "mem": 1024}}


def old_catalog(home: Path, script: str) -> sqlite3.Connection:
    home.mkdir()
    old = sqlite3.connect(home / "catalog.sqlite")
    old.executescript(script)
    return old


async def test_a_version_1_catalog_is_imported_and_gains_the_keys_limit(database: Database, tmp_path: Path) -> None:
    home = tmp_path / "old-home"
    old = old_catalog(home, VERSION_1)
    old.execute("INSERT INTO api_keys (id,name,key_hash,prefix,created_at) VALUES ('key_1','ci',?,'e2b_0000',1.0)",
                (hash_key("e2b_0000"),))
    old.execute("INSERT INTO api_keys (id,name,key_hash,prefix,created_at) VALUES ('key_2','old',?,'ks_abab',2.0)",
                (hash_key("ks_" + "ab" * 20),))
    old.execute("INSERT INTO sandboxes VALUES ('old','paused','base','d','',-1,'','tok',1.0,1.0,2,512,'key_1',?)",
                (json.dumps(OLD_DOC),))
    old.execute("INSERT INTO snapshots VALUES ('snap1', ?, 'CK', 'old', 'base', 5.0)", (json.dumps(["n", "m"]),))
    old.commit()
    old.close()

    counts = await import_home(database, home, "local")
    assert counts is not None and (counts["api_keys"], counts["sandboxes"], counts["snapshots"]) == (2, 1, 1)
    assert not (home / "catalog.sqlite").exists() and (home / "catalog.sqlite.imported").is_file()
    assert await import_home(database, home, "local") is None  # imported once

    keys = Keys(database)
    key = await find(keys, "e2b_0000")
    assert key is not None and key.name == "ci" and key.max_sandboxes is None  # the column version 2 added
    assert await keys.set_limit("key_1", 5) and (await keys.get("key_1")).max_sandboxes == 5  # type: ignore[union-attr]
    older = await find(keys, "ks_" + "ab" * 20)  # a key in our own older format still works
    assert older is not None and older.id == "key_2"

    got = await SandboxRows(database).get("old")  # a row of before the typed settings still loads
    assert got is not None and got.state is State.PAUSED and got.api_key_id == "key_1"
    s = got.settings
    assert (s.metadata, s.env_vars, s.auto_pause, s.allow_internet_access) == ({"k": "v"}, {"A": "1"}, True, False)
    assert (s.gateway_token, s.checkpoint_id, s.session_id) == ("gt", "CK1", "old")
    assert s.standby == Instance("ks-9", 9, "10.88.0.38", 3.0, 1024)
    assert s.retired is None and s.volume_mounts == [] and Settings.from_json({"metadata": {}}).volume_mounts == []
    assert [r.sandbox_id for r in await SandboxRows(database).list((State.PAUSED,))] == ["old"]

    snap = await Snapshots(database).by_name("m")  # the names of a JSON list became rows
    assert snap is not None and snap.snapshot_id == "snap1" and snap.names == ("m", "n")

    # What later versions added is there to use: teardowns (the new schema's), templates (version 4).
    rows = SandboxRows(database)
    await rows.add_teardown("ks-9", 9)
    assert [t.runtime_name for t in await rows.teardowns()] == ["ks-9"]
    templates = Templates(database)
    await templates.put_layer("k", "ckpt", {"user": "root"})
    layer = await templates.get_layer("k")
    assert layer is not None and (layer.checkpoint_id, layer.state) == ("ckpt", {"user": "root"})
    new, secret = await issue(keys, "new")
    assert (await find(keys, secret)).id == new.id  # type: ignore[union-attr]


async def test_a_version_3_catalog_is_imported_and_gains_the_template_tables(database: Database,
                                                                            tmp_path: Path) -> None:
    home = tmp_path / "old-home"
    old = old_catalog(home, VERSION_3)
    old.execute("INSERT INTO api_keys VALUES ('key_1','ci',?,'e2b_0000',1.0,NULL,4)", (hash_key("e2b_0000"),))
    old.commit()
    old.close()
    counts = await import_home(database, home, "local")
    assert counts is not None and counts["api_keys"] == 1 and counts["templates"] == counts["template_layers"] == 0
    key = await find(Keys(database), "e2b_0000")
    assert key is not None and key.max_sandboxes == 4
    templates = Templates(database)
    await templates.put_layer("k", "ckpt", {"user": "root"})
    layer = await templates.get_layer("k")
    assert layer is not None and (layer.checkpoint_id, layer.state) == ("ckpt", {"user": "root"})
    assert await templates.templates() == []
