"""The catalog: API keys, sandboxes, snapshots, volumes and secrets, in SQLite (WAL) behind a small interface.

Everything the server must remember across a crash lives here, so a server killed with
SIGKILL and started again re-adopts every live sandbox. The interface is narrow on purpose
so PostgreSQL can back it later; SQL stays in this module.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keepstate.errors import Conflict
from keepstate.sandbox.record import SandboxRow, Settings, TeardownRecord
from keepstate.sandbox.state import State
from keepstate.volume.record import VolumeRecord

SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    key_hash TEXT NOT NULL UNIQUE,
    prefix TEXT NOT NULL,
    created_at REAL NOT NULL,
    revoked_at REAL,
    max_sandboxes INTEGER
);
CREATE TABLE IF NOT EXISTS sandboxes (
    sandbox_id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    template_id TEXT NOT NULL,
    template_digest TEXT NOT NULL,
    runtime_name TEXT NOT NULL,
    slot INTEGER NOT NULL,
    address TEXT NOT NULL,
    access_token TEXT NOT NULL,
    started_at REAL NOT NULL,
    end_at REAL NOT NULL,
    cpu REAL NOT NULL,
    memory_mb INTEGER NOT NULL,
    api_key_id TEXT,
    doc TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS snapshots (
    snapshot_id TEXT PRIMARY KEY,
    names TEXT NOT NULL,
    checkpoint_id TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    template_id TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS volumes (
    volume_id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    token TEXT NOT NULL,
    size_mb INTEGER NOT NULL,
    created_at REAL NOT NULL
);
"""

# Version 1 (no `schema_version` in meta) had no api_keys.max_sandboxes; what turns it into version 2:
SCHEMA_VERSION = 4
_MIGRATE_1_TO_2 = ("ALTER TABLE api_keys ADD COLUMN max_sandboxes INTEGER",)
# Version 3 adds the secrets (keepstate/secret/): a row per secret, a row per version holding only ciphertext
# (AES-256-GCM, sealed by keepstate.secret.crypto; this module never sees a value). `seq` orders the list and is
# its paging cursor. A release reading version 2 refuses a version 3 catalog rather than ignore its secrets.
_MIGRATE_2_TO_3 = (
    """CREATE TABLE IF NOT EXISTS secrets (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        secret_id TEXT NOT NULL UNIQUE,
        name TEXT NOT NULL UNIQUE,
        current_version INTEGER NOT NULL,
        metadata TEXT NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS secret_versions (
        secret_id TEXT NOT NULL,
        version INTEGER NOT NULL,
        sealed BLOB NOT NULL,
        created_at REAL NOT NULL,
        PRIMARY KEY (secret_id, version)
    )""",
)


# Version 4 adds built templates (docs/design/template-builds.md): templates, their builds, tags, and the step
# cache's layers. A release reading version 3 refuses a version 4 catalog rather than ignore its templates.
_MIGRATE_3_TO_4 = (
    """CREATE TABLE IF NOT EXISTS templates (
        template_id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        cpu INTEGER NOT NULL,
        memory_mb INTEGER NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS template_builds (
        build_id TEXT PRIMARY KEY,
        template_id TEXT NOT NULL,
        status TEXT NOT NULL,
        checkpoint_id TEXT,
        sandbox_id TEXT,
        reason TEXT,
        created_at REAL NOT NULL,
        finished_at REAL
    )""",
    """CREATE TABLE IF NOT EXISTS template_tags (
        template_id TEXT NOT NULL,
        tag TEXT NOT NULL,
        build_id TEXT NOT NULL,
        created_at REAL NOT NULL,
        PRIMARY KEY (template_id, tag)
    )""",
    """CREATE TABLE IF NOT EXISTS template_layers (
        cache_key TEXT PRIMARY KEY,
        checkpoint_id TEXT NOT NULL,
        state TEXT NOT NULL,
        created_at REAL NOT NULL
    )""",
)


class CatalogError(RuntimeError):
    pass


# Additive steps, each its own and idempotent, run in order after SCHEMA on every open: a catalog written before a
# step gains what it adds, and nothing it had changes.
TEARDOWNS = """
CREATE TABLE IF NOT EXISTS teardowns (
    runtime_name TEXT PRIMARY KEY,
    slot INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_try REAL NOT NULL,
    last_error TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL
);
"""


@dataclass(frozen=True)
class SecretRow:
    """A secret's record without its value (the catalog holds only ciphertext, in `secret_versions`)."""

    secret_id: str
    name: str
    current_version: int
    metadata: dict[str, str]
    created_at: float
    updated_at: float
    seq: int


@dataclass
class TemplateRecord:
    """A built template (docs/design/template-builds.md): what a create names, by ID or name."""

    template_id: str
    name: str
    cpu: int
    memory_mb: int
    created_at: float
    updated_at: float


@dataclass
class BuildRecord:
    """One build of a template; `checkpoint_id` is its snapshot once `ready`."""

    build_id: str
    template_id: str
    status: str  # waiting | building | ready | error
    created_at: float
    checkpoint_id: str | None = None
    sandbox_id: str | None = None
    reason: dict[str, Any] | None = None
    finished_at: float | None = None


@dataclass
class ApiKey:
    id: str
    name: str
    prefix: str
    created_at: float
    revoked_at: float | None = None
    max_sandboxes: int | None = None  # running sandboxes at once; None: the server's --max-sandboxes-per-key


# E2B's format: some SDK releases (e2b 2.45) refuse any other before sending a request. Keys issued before in our
# own format ("ks_" + 40 hex) are still accepted: a key is looked up by its hash, whatever its shape.
API_KEY_FORMAT = re.compile(r"\Ae2b_[0-9a-f]+\Z")


def new_api_key() -> str:
    return "e2b_" + secrets.token_hex(20)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Catalog:
    """SQLite-backed; one connection guarded by a lock (calls are short)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
            self._db.executescript(TEARDOWNS)
            self._migrate()

    def _migrate(self) -> None:
        """Bring a catalog of an older schema to SCHEMA_VERSION (a server and the CLI may open it at once: one
        transaction decides)."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            row = self._db.execute("SELECT v FROM meta WHERE k='schema_version'").fetchone()
            version = int(row[0]) if row else 1
            if version > SCHEMA_VERSION:
                raise CatalogError(f"{self.path}: catalog schema version {version}; this release reads up to "
                                   f"{SCHEMA_VERSION} (a newer keepstate wrote it)")
            columns = {r[1] for r in self._db.execute("PRAGMA table_info(api_keys)")}
            if version < 2 and "max_sandboxes" not in columns:  # a new catalog has it from SCHEMA already
                for stmt in _MIGRATE_1_TO_2:
                    self._db.execute(stmt)
            if version < 3:
                for stmt in _MIGRATE_2_TO_3:
                    self._db.execute(stmt)
            if version < 4:
                for stmt in _MIGRATE_3_TO_4:
                    self._db.execute(stmt)
            self._db.execute("INSERT INTO meta (k,v) VALUES ('schema_version',?) ON CONFLICT(k) DO UPDATE "
                             "SET v=excluded.v", (str(SCHEMA_VERSION),))
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._db.close()

    def _q(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- API keys ------------------------------------------------------------------
    def create_key(self, name: str, key: str | None = None, max_sandboxes: int | None = None) -> tuple[ApiKey, str]:
        key = key or new_api_key()
        k = ApiKey(id="key_" + secrets.token_hex(6), name=name, prefix=key[:8], created_at=time.time(),
                   max_sandboxes=max_sandboxes)
        self._q("INSERT INTO api_keys (id,name,key_hash,prefix,created_at,max_sandboxes) VALUES (?,?,?,?,?,?)",
                (k.id, k.name, hash_key(key), k.prefix, k.created_at, max_sandboxes))
        return k, key

    def get_key(self, key_id: str) -> ApiKey | None:
        rows = self._q("SELECT * FROM api_keys WHERE id=?", (key_id,))
        return self._key(rows[0]) if rows else None

    def set_key_limit(self, key_id: str, max_sandboxes: int | None) -> bool:
        """A key's own limit of running sandboxes (0: unlimited; None: the server's default)."""
        with self._lock:
            cur = self._db.execute("UPDATE api_keys SET max_sandboxes=? WHERE id=?", (max_sandboxes, key_id))
            return cur.rowcount > 0

    def find_key(self, key: str) -> ApiKey | None:
        rows = self._q("SELECT * FROM api_keys WHERE key_hash=? AND revoked_at IS NULL", (hash_key(key),))
        return self._key(rows[0]) if rows else None

    def list_keys(self) -> list[ApiKey]:
        return [self._key(r) for r in self._q("SELECT * FROM api_keys ORDER BY created_at")]

    def revoke_key(self, key_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("UPDATE api_keys SET revoked_at=? WHERE id=? AND revoked_at IS NULL",
                                   (time.time(), key_id))
            return cur.rowcount > 0

    @staticmethod
    def _key(r: sqlite3.Row) -> ApiKey:
        return ApiKey(id=r["id"], name=r["name"], prefix=r["prefix"], created_at=r["created_at"],
                      revoked_at=r["revoked_at"], max_sandboxes=r["max_sandboxes"])

    def get_meta(self, k: str) -> str | None:
        rows = self._q("SELECT v FROM meta WHERE k=?", (k,))
        return rows[0]["v"] if rows else None

    def set_meta(self, k: str, v: str) -> None:
        self._q("INSERT INTO meta (k,v) VALUES (?,?) ON CONFLICT(k) DO UPDATE SET v=excluded.v", (k, v))

    # -- sandboxes -----------------------------------------------------------------
    def put_sandbox(self, s: SandboxRow) -> None:
        self._q(
            "INSERT INTO sandboxes (sandbox_id,state,template_id,template_digest,runtime_name,slot,address,"
            "access_token,started_at,end_at,cpu,memory_mb,api_key_id,doc) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?) "
            "ON CONFLICT(sandbox_id) DO UPDATE SET state=excluded.state, template_id=excluded.template_id, "
            "template_digest=excluded.template_digest, runtime_name=excluded.runtime_name, slot=excluded.slot, "
            "address=excluded.address, access_token=excluded.access_token, started_at=excluded.started_at, "
            "end_at=excluded.end_at, cpu=excluded.cpu, memory_mb=excluded.memory_mb, "
            "api_key_id=excluded.api_key_id, doc=excluded.doc",
            (s.sandbox_id, s.state, s.template_id, s.template_digest, s.runtime_name, s.slot, s.address,
             s.access_token, s.started_at, s.end_at, s.cpu, s.memory_mb, s.api_key_id,
             json.dumps(s.settings.to_json())),
        )

    def rename_sandbox(self, old_id: str, new: SandboxRow) -> None:
        """Claim a pooled sandbox under its public ID, atomically."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM sandboxes WHERE sandbox_id=?", (old_id,))
                self._db.execute(
                    "INSERT INTO sandboxes (sandbox_id,state,template_id,template_digest,runtime_name,slot,"
                    "address,access_token,started_at,end_at,cpu,memory_mb,api_key_id,doc) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (new.sandbox_id, new.state, new.template_id, new.template_digest, new.runtime_name,
                     new.slot, new.address, new.access_token, new.started_at, new.end_at, new.cpu,
                     new.memory_mb, new.api_key_id, json.dumps(new.settings.to_json())))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def delete_sandbox(self, sandbox_id: str) -> None:
        self._q("DELETE FROM sandboxes WHERE sandbox_id=?", (sandbox_id,))

    def get_sandbox(self, sandbox_id: str) -> SandboxRow | None:
        rows = self._q("SELECT * FROM sandboxes WHERE sandbox_id=?", (sandbox_id,))
        return self._sandbox(rows[0]) if rows else None

    def sandboxes(self, states: tuple[State, ...] | None = None) -> list[SandboxRow]:
        if states:
            marks = ",".join("?" * len(states))
            rows = self._q(f"SELECT * FROM sandboxes WHERE state IN ({marks})", tuple(str(s) for s in states))
        else:
            rows = self._q("SELECT * FROM sandboxes")
        return [self._sandbox(r) for r in rows]

    # -- snapshots (checkpoints usable as templateID) ------------------------------------
    def put_snapshot(self, snapshot_id: str, names: list[str], checkpoint_id: str, sandbox_id: str,
                     template_id: str) -> None:
        self._q("INSERT INTO snapshots (snapshot_id,names,checkpoint_id,sandbox_id,template_id,created_at) "
                "VALUES (?,?,?,?,?,?)",
                (snapshot_id, json.dumps(names), checkpoint_id, sandbox_id, template_id, time.time()))

    def get_snapshot(self, snapshot_id: str) -> dict[str, Any] | None:
        rows = self._q("SELECT * FROM snapshots WHERE snapshot_id=?", (snapshot_id,))
        return self._snapshot(rows[0]) if rows else None

    def snapshots(self) -> list[dict[str, Any]]:
        return [self._snapshot(r) for r in self._q("SELECT * FROM snapshots ORDER BY created_at, snapshot_id")]

    def delete_snapshot(self, snapshot_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM snapshots WHERE snapshot_id=?", (snapshot_id,)).rowcount > 0

    @staticmethod
    def _snapshot(r: sqlite3.Row) -> dict[str, Any]:
        return {"snapshot_id": r["snapshot_id"], "names": json.loads(r["names"]), "checkpoint_id": r["checkpoint_id"],
                "sandbox_id": r["sandbox_id"], "template_id": r["template_id"], "created_at": r["created_at"]}

    # -- built templates (docs/design/template-builds.md) ----------------------------------------------------------
    def put_template(self, t: TemplateRecord) -> None:
        """Record a new template; Conflict when its name is taken."""
        try:
            self._q("INSERT INTO templates (template_id,name,cpu,memory_mb,created_at,updated_at) VALUES (?,?,?,?,?,?)",
                    (t.template_id, t.name, t.cpu, t.memory_mb, t.created_at, t.updated_at))
        except sqlite3.IntegrityError:
            raise Conflict(f"a template named '{t.name}' exists") from None

    def update_template(self, template_id: str, cpu: int, memory_mb: int) -> None:
        self._q("UPDATE templates SET cpu=?, memory_mb=?, updated_at=? WHERE template_id=?",
                (cpu, memory_mb, time.time(), template_id))

    def get_template(self, ref: str) -> TemplateRecord | None:
        """By ID or by name."""
        rows = self._q("SELECT * FROM templates WHERE template_id=? OR name=?", (ref, ref))
        return self._template(rows[0]) if rows else None

    def templates(self) -> list[TemplateRecord]:
        return [self._template(r) for r in self._q("SELECT * FROM templates ORDER BY created_at, template_id")]

    def delete_template(self, template_id: str) -> list[str]:
        """Forget a template, its builds and tags in one transaction; the checkpoints its builds held."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                held = [r[0] for r in self._db.execute(
                    "SELECT checkpoint_id FROM template_builds WHERE template_id=? AND checkpoint_id IS NOT NULL",
                    (template_id,))]
                for table in ("templates", "template_builds", "template_tags"):
                    self._db.execute(f"DELETE FROM {table} WHERE template_id=?", (template_id,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return held

    def put_build(self, b: BuildRecord) -> None:
        self._q("INSERT INTO template_builds (build_id,template_id,status,checkpoint_id,sandbox_id,reason,created_at,"
                "finished_at) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(build_id) DO UPDATE SET status=excluded.status, "
                "checkpoint_id=excluded.checkpoint_id, sandbox_id=excluded.sandbox_id, reason=excluded.reason, "
                "finished_at=excluded.finished_at",
                (b.build_id, b.template_id, b.status, b.checkpoint_id, b.sandbox_id,
                 json.dumps(b.reason) if b.reason is not None else None, b.created_at, b.finished_at))

    def get_build(self, build_id: str) -> BuildRecord | None:
        rows = self._q("SELECT * FROM template_builds WHERE build_id=?", (build_id,))
        return self._build(rows[0]) if rows else None

    def builds(self, template_id: str | None = None) -> list[BuildRecord]:
        if template_id is None:
            rows = self._q("SELECT * FROM template_builds ORDER BY created_at")
        else:
            rows = self._q("SELECT * FROM template_builds WHERE template_id=? ORDER BY created_at", (template_id,))
        return [self._build(r) for r in rows]

    def publish_build(self, b: BuildRecord, tags: list[str]) -> None:
        """A build becomes `ready` and its tags point at it, in one transaction: a create sees all or nothing."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("UPDATE template_builds SET status=?, checkpoint_id=?, sandbox_id=?, reason=NULL, "
                                 "finished_at=? WHERE build_id=?",
                                 (b.status, b.checkpoint_id, b.sandbox_id, b.finished_at, b.build_id))
                for tag in tags:
                    self._db.execute("INSERT INTO template_tags (template_id,tag,build_id,created_at) VALUES "
                                     "(?,?,?,?) ON CONFLICT(template_id,tag) DO UPDATE SET build_id=excluded.build_id,"
                                     " created_at=excluded.created_at", (b.template_id, tag, b.build_id, time.time()))
                self._db.execute("UPDATE templates SET updated_at=? WHERE template_id=?", (time.time(), b.template_id))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def set_tag(self, template_id: str, tag: str, build_id: str) -> None:
        self._q("INSERT INTO template_tags (template_id,tag,build_id,created_at) VALUES (?,?,?,?) "
                "ON CONFLICT(template_id,tag) DO UPDATE SET build_id=excluded.build_id, created_at=excluded.created_at",
                (template_id, tag, build_id, time.time()))

    def delete_tag(self, template_id: str, tag: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM template_tags WHERE template_id=? AND tag=?",
                                    (template_id, tag)).rowcount > 0

    def tags(self, template_id: str) -> list[dict[str, Any]]:
        return [{"tag": r["tag"], "build_id": r["build_id"], "created_at": r["created_at"]}
                for r in self._q("SELECT * FROM template_tags WHERE template_id=? ORDER BY created_at, tag",
                                 (template_id,))]

    def tag_build(self, template_id: str, tag: str) -> str | None:
        rows = self._q("SELECT build_id FROM template_tags WHERE template_id=? AND tag=?", (template_id, tag))
        return str(rows[0][0]) if rows else None

    def put_layer(self, cache_key: str, checkpoint_id: str, state: dict[str, Any]) -> None:
        self._q("INSERT INTO template_layers (cache_key,checkpoint_id,state,created_at) VALUES (?,?,?,?) "
                "ON CONFLICT(cache_key) DO UPDATE SET checkpoint_id=excluded.checkpoint_id, state=excluded.state, "
                "created_at=excluded.created_at", (cache_key, checkpoint_id, json.dumps(state), time.time()))

    def get_layer(self, cache_key: str) -> tuple[str, dict[str, Any]] | None:
        rows = self._q("SELECT checkpoint_id, state FROM template_layers WHERE cache_key=?", (cache_key,))
        return (str(rows[0][0]), json.loads(rows[0][1])) if rows else None

    def delete_layer(self, cache_key: str) -> None:
        self._q("DELETE FROM template_layers WHERE cache_key=?", (cache_key,))

    @staticmethod
    def _template(r: sqlite3.Row) -> TemplateRecord:
        return TemplateRecord(template_id=r["template_id"], name=r["name"], cpu=r["cpu"], memory_mb=r["memory_mb"],
                              created_at=r["created_at"], updated_at=r["updated_at"])

    @staticmethod
    def _build(r: sqlite3.Row) -> BuildRecord:
        return BuildRecord(build_id=r["build_id"], template_id=r["template_id"], status=r["status"],
                           checkpoint_id=r["checkpoint_id"], sandbox_id=r["sandbox_id"],
                           reason=json.loads(r["reason"]) if r["reason"] else None, created_at=r["created_at"],
                           finished_at=r["finished_at"])

    # -- volumes (docs/design/volumes.md) ----------------------------------------------------------------------
    def put_volume(self, v: VolumeRecord) -> None:
        """Record a new volume; Conflict when its name is taken (the UNIQUE constraint decides a race)."""
        try:
            self._q("INSERT INTO volumes (volume_id,name,token,size_mb,created_at) VALUES (?,?,?,?,?)",
                    (v.volume_id, v.name, v.token, v.size_mb, v.created_at))
        except sqlite3.IntegrityError:
            raise Conflict(f"a volume named '{v.name}' exists") from None

    def get_volume(self, volume_id: str) -> VolumeRecord | None:
        rows = self._q("SELECT * FROM volumes WHERE volume_id=?", (volume_id,))
        return self._volume(rows[0]) if rows else None

    def volume_by_name(self, name: str) -> VolumeRecord | None:
        rows = self._q("SELECT * FROM volumes WHERE name=?", (name,))
        return self._volume(rows[0]) if rows else None

    def volumes(self) -> list[VolumeRecord]:
        return [self._volume(r) for r in self._q("SELECT * FROM volumes ORDER BY created_at, volume_id")]

    def delete_volume(self, volume_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM volumes WHERE volume_id=?", (volume_id,)).rowcount > 0

    @staticmethod
    def _volume(r: sqlite3.Row) -> VolumeRecord:
        return VolumeRecord(volume_id=r["volume_id"], name=r["name"], token=r["token"], size_mb=r["size_mb"],
                            created_at=r["created_at"])

    # -- secrets (keepstate/secret/store.py; values arrive and leave sealed) --------------------------------------
    def put_secret(self, row: SecretRow, sealed: bytes) -> SecretRow:
        """Record a new secret and its version 1; Conflict when its name is taken (UNIQUE decides a race)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                cur = self._db.execute(
                    "INSERT INTO secrets (secret_id,name,current_version,metadata,created_at,updated_at) "
                    "VALUES (?,?,?,?,?,?)", (row.secret_id, row.name, row.current_version,
                                             json.dumps(row.metadata), row.created_at, row.updated_at))
                self._db.execute("INSERT INTO secret_versions (secret_id,version,sealed,created_at) VALUES (?,?,?,?)",
                                 (row.secret_id, row.current_version, sealed, row.created_at))
                self._db.execute("COMMIT")
            except sqlite3.IntegrityError:
                self._db.execute("ROLLBACK")
                raise Conflict(f"a secret named '{row.name}' exists") from None
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return SecretRow(row.secret_id, row.name, row.current_version, row.metadata, row.created_at,
                         row.updated_at, int(cur.lastrowid or 0))

    def add_secret_version(self, secret_id: str, seal: Callable[[int], bytes], metadata: dict[str, str] | None,
                           now: float) -> SecretRow | None:
        """Store the secret's next version, sealed by `seal(version)` inside the transaction (so two updates cannot
        both take one number); `metadata` replaces the stored one unless None. None: no such secret."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                found = self._db.execute("SELECT * FROM secrets WHERE secret_id=?", (secret_id,)).fetchone()
                if found is None:
                    self._db.execute("ROLLBACK")
                    return None
                version = int(found["current_version"]) + 1
                self._db.execute("INSERT INTO secret_versions (secret_id,version,sealed,created_at) VALUES (?,?,?,?)",
                                 (secret_id, version, seal(version), now))
                if metadata is None:
                    self._db.execute("UPDATE secrets SET current_version=?, updated_at=? WHERE secret_id=?",
                                     (version, now, secret_id))
                else:
                    self._db.execute("UPDATE secrets SET current_version=?, updated_at=?, metadata=? WHERE "
                                     "secret_id=?", (version, now, json.dumps(metadata), secret_id))
                row = self._db.execute("SELECT * FROM secrets WHERE secret_id=?", (secret_id,)).fetchone()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return self._secret(row)

    def get_secret(self, secret_id: str) -> SecretRow | None:
        rows = self._q("SELECT * FROM secrets WHERE secret_id=?", (secret_id,))
        return self._secret(rows[0]) if rows else None

    def secret_by_name(self, name: str) -> SecretRow | None:
        rows = self._q("SELECT * FROM secrets WHERE name=?", (name,))
        return self._secret(rows[0]) if rows else None

    def secrets_after(self, seq: int, limit: int) -> list[SecretRow]:
        """Up to `limit` secrets created after the one numbered `seq` (0: from the first), oldest first."""
        rows = self._q("SELECT * FROM secrets WHERE seq>? ORDER BY seq LIMIT ?", (seq, limit))
        return [self._secret(r) for r in rows]

    def secret_sealed(self, secret_id: str, version: int) -> bytes | None:
        rows = self._q("SELECT sealed FROM secret_versions WHERE secret_id=? AND version=?", (secret_id, version))
        return bytes(rows[0]["sealed"]) if rows else None

    def count_secrets(self) -> int:
        return int(self._q("SELECT COUNT(*) FROM secrets")[0][0])

    def delete_secret(self, secret_id: str) -> bool:
        """Forget the secret and every version's ciphertext, in one transaction."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                gone = self._db.execute("DELETE FROM secrets WHERE secret_id=?", (secret_id,)).rowcount > 0
                self._db.execute("DELETE FROM secret_versions WHERE secret_id=?", (secret_id,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return gone

    @staticmethod
    def _secret(r: sqlite3.Row) -> SecretRow:
        return SecretRow(secret_id=r["secret_id"], name=r["name"], current_version=r["current_version"],
                         metadata=json.loads(r["metadata"]), created_at=r["created_at"],
                         updated_at=r["updated_at"], seq=r["seq"])

    # -- teardowns (docs/design/teardown.md) ---------------------------------------------------------------------
    def put_teardown(self, runtime_name: str, slot: int) -> None:
        """Record a teardown to do; one already recorded for the instance keeps its attempts."""
        self._q("INSERT INTO teardowns (runtime_name,slot,attempts,next_try,last_error,created_at) "
                "VALUES (?,?,0,?,'',?) ON CONFLICT(runtime_name) DO NOTHING",
                (runtime_name, slot, time.time(), time.time()))

    def teardown_failed(self, runtime_name: str, attempts: int, next_try: float, error: str) -> None:
        self._q("UPDATE teardowns SET attempts=?, next_try=?, last_error=? WHERE runtime_name=?",
                (attempts, next_try, error[:2000], runtime_name))

    def delete_teardown(self, runtime_name: str) -> None:
        self._q("DELETE FROM teardowns WHERE runtime_name=?", (runtime_name,))

    def teardowns(self) -> list[TeardownRecord]:
        return [TeardownRecord(r["runtime_name"], r["slot"], r["attempts"], r["next_try"], r["last_error"])
                for r in self._q("SELECT * FROM teardowns ORDER BY next_try, runtime_name")]

    def used_slots(self) -> set[int]:
        return {r["slot"] for r in self._q("SELECT slot FROM sandboxes WHERE slot >= 0")}

    @staticmethod
    def _sandbox(r: sqlite3.Row) -> SandboxRow:
        return SandboxRow(
            sandbox_id=r["sandbox_id"], state=State(r["state"]), template_id=r["template_id"],
            template_digest=r["template_digest"], runtime_name=r["runtime_name"], slot=r["slot"],
            address=r["address"], access_token=r["access_token"], started_at=r["started_at"],
            end_at=r["end_at"], cpu=r["cpu"], memory_mb=r["memory_mb"], api_key_id=r["api_key_id"],
            settings=Settings.from_json(json.loads(r["doc"])),
        )
