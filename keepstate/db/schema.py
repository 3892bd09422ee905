"""Every table of the one database (docs/design/database.md, "Schema"), in SQLAlchemy Core, for SQLite and PostgreSQL.

Columns are those of the three SQLite files before it (catalog, sessions, gateway; db/legacy.py imports them)
except where the design changes them:
`sandboxes` gains node_id, epoch and version (and an index on (node_id, state)); a snapshot's names move into
`snapshot_names`; the secrets' key fingerprint moves from `meta` into the one-row `secrets_key`; the `meta` tables go
(Alembic's `alembic_version` is the one version scheme).

Types: times stay REAL seconds (Float: DOUBLE PRECISION on PostgreSQL); JSON documents stay Text; blobs LargeBinary.
SQLite's INTEGER is 64-bit and PostgreSQL's is not, so counters that grow without bound (sequence numbers,
positions, cursors, tokens, nano-dollar amounts, versions, epochs) are BigInteger; small bounded numbers (slots, cpu,
memory, HTTP statuses, 0/1 flags, attempts) stay Integer. Keys that were INTEGER PRIMARY KEY AUTOINCREMENT stay that
on SQLite (`_serial`, `sqlite_autoincrement`: an ID is never reused) and are BIGSERIAL on PostgreSQL.

Revision 0001 (migrations/versions/0001_initial.py) writes the same tables out as explicit operations; a test
compares the two, so this module is what the latest revision creates.
"""

from __future__ import annotations

import sqlalchemy as sa

# Constraint names as PostgreSQL would choose them, spelled out so that a later revision (and SQLite's batch mode,
# which rebuilds a table) can name what it alters on both databases.
NAMING = {
    "pk": "%(table_name)s_pkey",
    "uq": "%(table_name)s_%(column_0_N_name)s_key",
    "ck": "%(table_name)s_%(constraint_name)s_check",
    "fk": "%(table_name)s_%(column_0_N_name)s_fkey",
    "ix": "%(table_name)s_%(column_0_N_name)s",
}

metadata = sa.MetaData(naming_convention=NAMING)

_serial = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite autoincrements only INTEGER PRIMARY KEY


def _text(name: str, nullable: bool = False, *, primary_key: bool = False, unique: bool | None = None,
          server_default: sa.TextClause | None = None) -> sa.Column[str]:
    return sa.Column(name, sa.Text(), nullable=nullable, primary_key=primary_key, unique=unique,
                     server_default=server_default)


def _time(name: str, nullable: bool = False) -> sa.Column[float]:
    return sa.Column(name, sa.Float(), nullable=nullable)


# -- API keys -------------------------------------------------------------------------------------------------------
api_keys = sa.Table(
    "api_keys", metadata,
    _text("id", primary_key=True),
    _text("name"),
    _text("key_hash", unique=True),
    _text("prefix"),
    _time("created_at"),
    _time("revoked_at", nullable=True),
    sa.Column("max_sandboxes", sa.Integer()),
)

# -- sandboxes ------------------------------------------------------------------------------------------------------
sandboxes = sa.Table(
    "sandboxes", metadata,
    _text("sandbox_id", primary_key=True),
    _text("state"),
    _text("template_id"),
    _text("template_digest"),
    _text("runtime_name"),
    sa.Column("slot", sa.Integer(), nullable=False),
    _text("address"),
    _text("access_token"),
    _time("started_at"),
    _time("end_at"),
    sa.Column("cpu", sa.Float(), nullable=False),
    sa.Column("memory_mb", sa.Integer(), nullable=False),
    _text("api_key_id", nullable=True),
    _text("doc"),  # the typed Settings (msgspec) as JSON
    _text("node_id"),  # the node whose server owns the row ("local" on one host)
    sa.Column("epoch", sa.BigInteger(), nullable=False, server_default=sa.text("0")),  # fencing token (issue 27)
    sa.Column("version", sa.BigInteger(), nullable=False, server_default=sa.text("0")),  # optimistic concurrency
    _time("paused_at", nullable=True),  # when it was paused, by the database's clock (0003; the repository keeps it)
    # Handed over by a node that stopped (`--on-stop handover`): its new node resumes it at once (revision 0004).
    sa.Column("resume_pending", sa.Boolean(), nullable=False, server_default=sa.false()),
    sa.Index("sandboxes_state", "state"),
    sa.Index("sandboxes_node_state", "node_id", "state"),
)

teardowns = sa.Table(
    "teardowns", metadata,
    _text("runtime_name", primary_key=True),
    sa.Column("slot", sa.Integer(), nullable=False),
    sa.Column("attempts", sa.Integer(), nullable=False, server_default=sa.text("0")),
    _time("next_try"),
    _text("last_error", server_default=sa.text("''")),
    _time("created_at"),
    _text("node_id", server_default=sa.text("'local'")),  # the node whose host holds the instance (0002)
    sa.Index("teardowns_node_next", "node_id", "next_try"),
)

# -- nodes (revision 0002; docs/design/cluster.md) ------------------------------------------------------------------
nodes = sa.Table(
    "nodes", metadata,
    _text("node_id", primary_key=True),
    sa.Column("incarnation", sa.BigInteger(), nullable=False),  # moves at every join: the lease's owner
    _text("state"),  # alive | draining | dead | left | removed
    _text("address"),  # the URL other nodes reach it on (--advertise)
    sa.Column("cpus", sa.Float(), nullable=False),
    sa.Column("memory_mb", sa.BigInteger(), nullable=False),
    sa.Column("max_sandboxes", sa.Integer(), nullable=False),
    _text("runsc_release"),
    _text("cpu_features"),  # JSON list
    _text("templates"),  # JSON list: the templates it keeps warm
    _text("metrics", server_default=sa.text("'{}'")),  # JSON, sent with each renewal
    _time("joined_at"),
    _time("lease_expires_at"),  # the database's clock
)

# -- leases (revision 0003; docs/design/cluster.md, "Lifetimes and retention") --------------------------------------
leases = sa.Table(  # a named lease one holder at a time has, judged by the database's clock (`store-gc`)
    "leases", metadata,
    _text("name", primary_key=True),
    _text("holder"),  # who holds it; '' once released
    sa.Column("token", sa.BigInteger(), nullable=False),  # moves at every acquisition: a fencing token
    _time("expires_at"),  # the database's clock
)

# -- idempotent creates (docs/design/idempotency.md) ----------------------------------------------------------------
idempotency = sa.Table(
    "idempotency", metadata,
    _text("api_key_id"),  # the scope ('' for a request without an API key)
    _text("key"),  # the client's Idempotency-Key
    _text("digest"),  # SHA-256 of the request (method, path, canonical body)
    _text("sandbox_id"),  # chosen before the create starts; the create uses it
    _text("state"),  # in_progress | done
    _text("owner"),  # node/<node>/<incarnation> of the server that runs it
    _text("response", nullable=True),  # the 201 body once done
    _time("created_at"),  # the database's clock
    _time("expires_at"),
    sa.PrimaryKeyConstraint("api_key_id", "key", name="idempotency_pkey"),
    sa.Index("idempotency_expires", "expires_at"),
)

# -- snapshots ------------------------------------------------------------------------------------------------------
snapshots = sa.Table(
    "snapshots", metadata,
    _text("snapshot_id", primary_key=True),
    _text("checkpoint_id"),
    _text("sandbox_id"),
    _text("template_id"),
    _time("created_at"),
)

snapshot_names = sa.Table(
    "snapshot_names", metadata,
    _text("name", primary_key=True),
    _text("snapshot_id"),
    sa.Index("snapshot_names_snapshot", "snapshot_id"),
)

# -- templates and builds ------------------------------------------------------------------------------------------
templates = sa.Table(
    "templates", metadata,
    _text("template_id", primary_key=True),
    _text("name", unique=True),
    sa.Column("cpu", sa.Integer(), nullable=False),
    sa.Column("memory_mb", sa.Integer(), nullable=False),
    _time("created_at"),
    _time("updated_at"),
)

template_builds = sa.Table(
    "template_builds", metadata,
    _text("build_id", primary_key=True),
    _text("template_id"),
    _text("status"),
    _text("checkpoint_id", nullable=True),
    _text("sandbox_id", nullable=True),
    _text("reason", nullable=True),
    _time("created_at"),
    _time("finished_at", nullable=True),
)

template_tags = sa.Table(
    "template_tags", metadata,
    _text("template_id", primary_key=True),
    _text("tag", primary_key=True),
    _text("build_id"),
    _time("created_at"),
)

template_layers = sa.Table(
    "template_layers", metadata,
    _text("cache_key", primary_key=True),
    _text("checkpoint_id"),
    _text("state"),
    _time("created_at"),
)

# -- volumes --------------------------------------------------------------------------------------------------------
volumes = sa.Table(
    "volumes", metadata,
    _text("volume_id", primary_key=True),
    _text("name", unique=True),
    _text("token"),
    sa.Column("size_mb", sa.Integer(), nullable=False),
    _time("created_at"),
)

# -- secrets --------------------------------------------------------------------------------------------------------
secrets = sa.Table(
    "secrets", metadata,
    sa.Column("seq", _serial, primary_key=True, autoincrement=True),  # orders the list; its paging cursor
    _text("secret_id", unique=True),
    _text("name", unique=True),
    sa.Column("current_version", sa.Integer(), nullable=False),
    _text("metadata"),
    _time("created_at"),
    _time("updated_at"),
    sqlite_autoincrement=True,
)

secret_versions = sa.Table(
    "secret_versions", metadata,
    _text("secret_id", primary_key=True),
    sa.Column("version", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("sealed", sa.LargeBinary(), nullable=False),  # AES-256-GCM ciphertext only
    _time("created_at"),
)

secrets_key = sa.Table(  # one row: the fingerprint of the key every secret is sealed with
    "secrets_key", metadata,
    sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False, server_default=sa.text("1")),
    _text("fingerprint"),
    sa.CheckConstraint("id = 1", name="one_row"),
)

# -- session history ------------------------------------------------------------------------------------------------
events = sa.Table(
    "events", metadata,
    _text("session_id", primary_key=True),
    sa.Column("seq", sa.BigInteger(), primary_key=True, autoincrement=False),
    _time("ts"),
    _text("kind"),
    _text("data"),
    _text("prev"),
    _text("hash"),
)

heads = sa.Table(
    "heads", metadata,
    _text("session_id", primary_key=True),
    sa.Column("seq", sa.BigInteger(), nullable=False),
    _text("hash"),
    sa.Column("journal_cursor", sa.BigInteger()),
)

sessions = sa.Table(
    "sessions", metadata,
    _text("session_id", primary_key=True),
    _text("template_id", nullable=True),
    _time("created"),
    _text("parent_session", nullable=True),
    _text("parent_checkpoint_id", nullable=True),
    _text("state"),
    sa.Index("sessions_parent", "parent_session"),
    sa.Index("sessions_template", "template_id"),
)

checkpoints = sa.Table(
    "checkpoints", metadata,
    _text("checkpoint_id", primary_key=True),
    _text("session_id"),
    _text("parent_checkpoint_id", nullable=True),
    _text("kind"),
    sa.Column("event_seq", sa.BigInteger()),
    _text("event_hash", nullable=True),
    sa.Column("journal_cursor", sa.BigInteger()),
    _time("created"),
    sa.Index("checkpoints_session", "session_id", "created"),
)

# -- gateway ledger -------------------------------------------------------------------------------------------------
runs = sa.Table(
    "runs", metadata,
    _text("run_id", primary_key=True),
    _text("token_hash", unique=True),
    _text("session_id"),
    _text("sandbox_id"),
    _text("api_key_id", nullable=True),
    _text("checkpoint_id", nullable=True),
    _text("mode"),
    _text("parent_session_id", nullable=True),
    _time("created_at"),
    _time("ended_at", nullable=True),
    sa.Column("aligned_at", sa.BigInteger()),  # a position, not a time
    _text("source_ip", nullable=True),
    sa.Index("runs_session", "session_id", "created_at"),
)

bindings = sa.Table(
    "bindings", metadata,
    _text("source_ip", primary_key=True),
    _text("run_id"),
    _time("created_at"),
    sa.Index("bindings_run", "run_id"),
)

marks = sa.Table(
    "marks", metadata,
    _text("checkpoint_id", primary_key=True),
    _text("session_id"),
    _text("run_id"),
    sa.Column("position", sa.BigInteger(), nullable=False),
    _time("created_at"),
    sa.Column("last_position", sa.BigInteger()),
)

positions = sa.Table(
    "positions", metadata,
    _text("run_id", primary_key=True),
    sa.Column("ordinal", sa.BigInteger(), primary_key=True, autoincrement=False),
    _text("call_key"),
    _text("body_hash"),
    _text("source"),
    sa.Column("delivered", sa.Integer(), nullable=False, server_default=sa.text("0")),
    _time("arrived_at", nullable=True),
    _time("delivered_at", nullable=True),
    sa.Index("positions_hash", "run_id", "body_hash", "ordinal"),
)

calls = sa.Table(
    "calls", metadata,
    _text("call_key", primary_key=True),
    _text("session_id"),
    _text("run_id"),
    _text("endpoint"),
    _text("provider"),
    _text("model"),
    sa.Column("stream", sa.Integer(), nullable=False),
    _text("body_hash"),
    _text("status"),
    sa.Column("http_status", sa.Integer()),
    _text("content_type", nullable=True),
    sa.Column("response", sa.LargeBinary()),
    _text("usage", nullable=True),
    _text("upstream_request_id", nullable=True),
    _text("owner", nullable=True),  # a node and an incarnation, not today's pid:nonce
    sa.Column("attempts", sa.Integer(), nullable=False, server_default=sa.text("0")),
    sa.Column("ok_entry_id", sa.BigInteger()),
    _time("created_at"),
    _time("finished_at", nullable=True),
    sa.Index("calls_status", "status"),
)

divergences = sa.Table(
    "divergences", metadata,
    sa.Column("id", _serial, primary_key=True, autoincrement=True),
    _text("run_id"),
    sa.Column("ordinal", sa.BigInteger(), nullable=False),
    _text("expected_call_key"),
    _text("expected_hash"),
    _text("got_hash"),
    _time("created_at"),
    sqlite_autoincrement=True,
)

_TOKENS = ("input_tokens", "output_tokens", "cached_tokens", "cache_write_tokens", "reasoning_tokens", "cost_nano")

ledger = sa.Table(
    "ledger", metadata,
    sa.Column("entry_id", _serial, primary_key=True, autoincrement=True),
    _text("kind"),
    _text("outcome"),
    _text("call_key"),
    _text("session_id"),
    _text("sandbox_id"),
    _text("api_key_id", nullable=True),
    _text("run_id"),
    _text("provider"),
    _text("model"),
    _text("endpoint"),
    sa.Column("http_status", sa.Integer()),
    *(sa.Column(name, sa.BigInteger(), nullable=False, server_default=sa.text("0")) for name in _TOKENS),
    sa.Column("priced", sa.Integer(), nullable=False),
    _text("upstream_request_id", nullable=True),
    sa.Column("original_entry_id", sa.BigInteger()),
    _time("started_at"),
    _time("finished_at"),
    sa.Index("ledger_session", "session_id", "entry_id"),
    sa.Index("ledger_call", "call_key"),
    sqlite_autoincrement=True,
)

budgets = sa.Table(
    "budgets", metadata,
    _text("scope", primary_key=True),
    _text("ident", primary_key=True),
    sa.Column("limit_nano", sa.BigInteger(), nullable=False),
    sa.Column("spent_nano", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
    sa.Column("reserved_nano", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
)

reservations = sa.Table(
    "reservations", metadata,
    sa.Column("id", _serial, primary_key=True, autoincrement=True),
    _text("call_key"),
    _text("owner"),
    _text("scope"),
    _text("ident"),
    sa.Column("amount_nano", sa.BigInteger(), nullable=False),
    sa.Index("reservations_call", "call_key"),
    sqlite_autoincrement=True,
)

TABLES = tuple(metadata.sorted_tables)
