"""The one database: every table of docs/design/database.md's "Schema", on SQLite and PostgreSQL.

Written out operation by operation (not generated at run time), so that what a database holds never depends on the
code of a later release; tests/db/test_migrations.py checks that it creates exactly keepstate.db.schema.

Revision ID: 0001
Revises:
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# Kept here, not imported from keepstate.db.schema, for the reason above.
_serial = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_ZERO = sa.text("0")


def _text(name: str, nullable: bool = False) -> sa.Column[str]:
    return sa.Column(name, sa.Text(), nullable=nullable)


def _time(name: str, nullable: bool = False) -> sa.Column[float]:
    return sa.Column(name, sa.Float(), nullable=nullable)


def _pk(table: str, *columns: str) -> sa.PrimaryKeyConstraint:
    return sa.PrimaryKeyConstraint(*columns, name=f"{table}_pkey")


def _unique(table: str, column: str) -> sa.UniqueConstraint:
    return sa.UniqueConstraint(column, name=f"{table}_{column}_key")


def upgrade() -> None:
    # -- API keys ----------------------------------------------------------------------------------------------------
    op.create_table(
        "api_keys",
        _text("id"), _text("name"), _text("key_hash"), _text("prefix"), _time("created_at"),
        _time("revoked_at", nullable=True), sa.Column("max_sandboxes", sa.Integer(), nullable=True),
        _pk("api_keys", "id"), _unique("api_keys", "key_hash"),
    )

    # -- sandboxes ---------------------------------------------------------------------------------------------------
    op.create_table(
        "sandboxes",
        _text("sandbox_id"), _text("state"), _text("template_id"), _text("template_digest"), _text("runtime_name"),
        sa.Column("slot", sa.Integer(), nullable=False), _text("address"), _text("access_token"),
        _time("started_at"), _time("end_at"), sa.Column("cpu", sa.Float(), nullable=False),
        sa.Column("memory_mb", sa.Integer(), nullable=False), _text("api_key_id", nullable=True), _text("doc"),
        _text("node_id"),
        sa.Column("epoch", sa.BigInteger(), nullable=False, server_default=_ZERO),
        sa.Column("version", sa.BigInteger(), nullable=False, server_default=_ZERO),
        _pk("sandboxes", "sandbox_id"),
    )
    op.create_index("sandboxes_state", "sandboxes", ["state"])
    op.create_index("sandboxes_node_state", "sandboxes", ["node_id", "state"])
    op.create_table(
        "teardowns",
        _text("runtime_name"), sa.Column("slot", sa.Integer(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default=_ZERO), _time("next_try"),
        sa.Column("last_error", sa.Text(), nullable=False, server_default=sa.text("''")), _time("created_at"),
        _pk("teardowns", "runtime_name"),
    )

    # -- snapshots ---------------------------------------------------------------------------------------------------
    op.create_table(
        "snapshots",
        _text("snapshot_id"), _text("checkpoint_id"), _text("sandbox_id"), _text("template_id"), _time("created_at"),
        _pk("snapshots", "snapshot_id"),
    )
    op.create_table("snapshot_names", _text("name"), _text("snapshot_id"), _pk("snapshot_names", "name"))
    op.create_index("snapshot_names_snapshot", "snapshot_names", ["snapshot_id"])

    # -- templates and builds ----------------------------------------------------------------------------------------
    op.create_table(
        "templates",
        _text("template_id"), _text("name"), sa.Column("cpu", sa.Integer(), nullable=False),
        sa.Column("memory_mb", sa.Integer(), nullable=False), _time("created_at"), _time("updated_at"),
        _pk("templates", "template_id"), _unique("templates", "name"),
    )
    op.create_table(
        "template_builds",
        _text("build_id"), _text("template_id"), _text("status"), _text("checkpoint_id", nullable=True),
        _text("sandbox_id", nullable=True), _text("reason", nullable=True), _time("created_at"),
        _time("finished_at", nullable=True),
        _pk("template_builds", "build_id"),
    )
    op.create_table(
        "template_tags",
        _text("template_id"), _text("tag"), _text("build_id"), _time("created_at"),
        _pk("template_tags", "template_id", "tag"),
    )
    op.create_table(
        "template_layers",
        _text("cache_key"), _text("checkpoint_id"), _text("state"), _time("created_at"),
        _pk("template_layers", "cache_key"),
    )

    # -- volumes -----------------------------------------------------------------------------------------------------
    op.create_table(
        "volumes",
        _text("volume_id"), _text("name"), _text("token"), sa.Column("size_mb", sa.Integer(), nullable=False),
        _time("created_at"),
        _pk("volumes", "volume_id"), _unique("volumes", "name"),
    )

    # -- secrets -----------------------------------------------------------------------------------------------------
    op.create_table(
        "secrets",
        sa.Column("seq", _serial, nullable=False, autoincrement=True), _text("secret_id"), _text("name"),
        sa.Column("current_version", sa.Integer(), nullable=False), _text("metadata"), _time("created_at"),
        _time("updated_at"),
        _pk("secrets", "seq"), _unique("secrets", "secret_id"), _unique("secrets", "name"),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "secret_versions",
        _text("secret_id"), sa.Column("version", sa.Integer(), nullable=False, autoincrement=False),
        sa.Column("sealed", sa.LargeBinary(), nullable=False), _time("created_at"),
        _pk("secret_versions", "secret_id", "version"),
    )
    op.create_table(
        "secrets_key",
        sa.Column("id", sa.Integer(), nullable=False, autoincrement=False, server_default=sa.text("1")),
        _text("fingerprint"),
        _pk("secrets_key", "id"), sa.CheckConstraint("id = 1", name="secrets_key_one_row_check"),
    )

    # -- session history ---------------------------------------------------------------------------------------------
    op.create_table(
        "events",
        _text("session_id"), sa.Column("seq", sa.BigInteger(), nullable=False, autoincrement=False), _time("ts"),
        _text("kind"), _text("data"), _text("prev"), _text("hash"),
        _pk("events", "session_id", "seq"),
    )
    op.create_table(
        "heads",
        _text("session_id"), sa.Column("seq", sa.BigInteger(), nullable=False), _text("hash"),
        sa.Column("journal_cursor", sa.BigInteger(), nullable=True),
        _pk("heads", "session_id"),
    )
    op.create_table(
        "sessions",
        _text("session_id"), _text("template_id", nullable=True), _time("created"),
        _text("parent_session", nullable=True), _text("parent_checkpoint_id", nullable=True), _text("state"),
        _pk("sessions", "session_id"),
    )
    op.create_index("sessions_parent", "sessions", ["parent_session"])
    op.create_index("sessions_template", "sessions", ["template_id"])
    op.create_table(
        "checkpoints",
        _text("checkpoint_id"), _text("session_id"), _text("parent_checkpoint_id", nullable=True), _text("kind"),
        sa.Column("event_seq", sa.BigInteger(), nullable=True), _text("event_hash", nullable=True),
        sa.Column("journal_cursor", sa.BigInteger(), nullable=True), _time("created"),
        _pk("checkpoints", "checkpoint_id"),
    )
    op.create_index("checkpoints_session", "checkpoints", ["session_id", "created"])

    # -- gateway ledger ----------------------------------------------------------------------------------------------
    op.create_table(
        "runs",
        _text("run_id"), _text("token_hash"), _text("session_id"), _text("sandbox_id"),
        _text("api_key_id", nullable=True), _text("checkpoint_id", nullable=True), _text("mode"),
        _text("parent_session_id", nullable=True), _time("created_at"), _time("ended_at", nullable=True),
        sa.Column("aligned_at", sa.BigInteger(), nullable=True), _text("source_ip", nullable=True),
        _pk("runs", "run_id"), _unique("runs", "token_hash"),
    )
    op.create_index("runs_session", "runs", ["session_id", "created_at"])
    op.create_table(
        "bindings",
        _text("source_ip"), _text("run_id"), _time("created_at"),
        _pk("bindings", "source_ip"),
    )
    op.create_index("bindings_run", "bindings", ["run_id"])
    op.create_table(
        "marks",
        _text("checkpoint_id"), _text("session_id"), _text("run_id"),
        sa.Column("position", sa.BigInteger(), nullable=False), _time("created_at"),
        sa.Column("last_position", sa.BigInteger(), nullable=True),
        _pk("marks", "checkpoint_id"),
    )
    op.create_table(
        "positions",
        _text("run_id"), sa.Column("ordinal", sa.BigInteger(), nullable=False, autoincrement=False),
        _text("call_key"), _text("body_hash"), _text("source"),
        sa.Column("delivered", sa.Integer(), nullable=False, server_default=_ZERO),
        _time("arrived_at", nullable=True), _time("delivered_at", nullable=True),
        _pk("positions", "run_id", "ordinal"),
    )
    op.create_index("positions_hash", "positions", ["run_id", "body_hash", "ordinal"])
    op.create_table(
        "calls",
        _text("call_key"), _text("session_id"), _text("run_id"), _text("endpoint"), _text("provider"), _text("model"),
        sa.Column("stream", sa.Integer(), nullable=False), _text("body_hash"), _text("status"),
        sa.Column("http_status", sa.Integer(), nullable=True), _text("content_type", nullable=True),
        sa.Column("response", sa.LargeBinary(), nullable=True), _text("usage", nullable=True),
        _text("upstream_request_id", nullable=True), _text("owner", nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default=_ZERO),
        sa.Column("ok_entry_id", sa.BigInteger(), nullable=True), _time("created_at"),
        _time("finished_at", nullable=True),
        _pk("calls", "call_key"),
    )
    op.create_index("calls_status", "calls", ["status"])
    op.create_table(
        "divergences",
        sa.Column("id", _serial, nullable=False, autoincrement=True), _text("run_id"),
        sa.Column("ordinal", sa.BigInteger(), nullable=False), _text("expected_call_key"), _text("expected_hash"),
        _text("got_hash"), _time("created_at"),
        _pk("divergences", "id"),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "ledger",
        sa.Column("entry_id", _serial, nullable=False, autoincrement=True), _text("kind"), _text("outcome"),
        _text("call_key"), _text("session_id"), _text("sandbox_id"), _text("api_key_id", nullable=True),
        _text("run_id"), _text("provider"), _text("model"), _text("endpoint"),
        sa.Column("http_status", sa.Integer(), nullable=True),
        *(sa.Column(name, sa.BigInteger(), nullable=False, server_default=_ZERO)
          for name in ("input_tokens", "output_tokens", "cached_tokens", "cache_write_tokens", "reasoning_tokens",
                       "cost_nano")),
        sa.Column("priced", sa.Integer(), nullable=False), _text("upstream_request_id", nullable=True),
        sa.Column("original_entry_id", sa.BigInteger(), nullable=True), _time("started_at"), _time("finished_at"),
        _pk("ledger", "entry_id"),
        sqlite_autoincrement=True,
    )
    op.create_index("ledger_session", "ledger", ["session_id", "entry_id"])
    op.create_index("ledger_call", "ledger", ["call_key"])
    op.create_table(
        "budgets",
        _text("scope"), _text("ident"), sa.Column("limit_nano", sa.BigInteger(), nullable=False),
        sa.Column("spent_nano", sa.BigInteger(), nullable=False, server_default=_ZERO),
        sa.Column("reserved_nano", sa.BigInteger(), nullable=False, server_default=_ZERO),
        _pk("budgets", "scope", "ident"),
    )
    op.create_table(
        "reservations",
        sa.Column("id", _serial, nullable=False, autoincrement=True), _text("call_key"), _text("owner"),
        _text("scope"), _text("ident"), sa.Column("amount_nano", sa.BigInteger(), nullable=False),
        _pk("reservations", "id"),
        sqlite_autoincrement=True,
    )
    op.create_index("reservations_call", "reservations", ["call_key"])


def downgrade() -> None:
    for table in ("reservations", "budgets", "ledger", "divergences", "calls", "positions", "marks", "bindings", "runs",
                  "checkpoints", "sessions", "heads", "events", "secrets_key", "secret_versions", "secrets",
                  "volumes", "template_layers", "template_tags", "template_builds", "templates", "snapshot_names",
                  "snapshots", "teardowns", "sandboxes", "api_keys"):
        op.drop_table(table)  # a table's indexes go with it
