"""Nodes and their leases, and the node of each teardown (docs/design/cluster.md).

A `nodes` row per node, its lease judged by the database's clock; `teardowns.node_id` so that a node's teardown
loop takes only the instances its own host holds (before: every teardown was the one server's). Existing teardowns
are the single server's, `local`.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def _text(name: str, nullable: bool = False, server_default: str | None = None) -> sa.Column[str]:
    return sa.Column(name, sa.Text(), nullable=nullable,
                     server_default=sa.text(server_default) if server_default is not None else None)


def _time(name: str) -> sa.Column[float]:
    return sa.Column(name, sa.Float(), nullable=False)


def upgrade() -> None:
    with op.batch_alter_table("teardowns") as batch:
        batch.add_column(_text("node_id", server_default="'local'"))
    op.create_index("teardowns_node_next", "teardowns", ["node_id", "next_try"])
    op.create_table(
        "nodes",
        _text("node_id"), sa.Column("incarnation", sa.BigInteger(), nullable=False), _text("state"),
        _text("address"), sa.Column("cpus", sa.Float(), nullable=False),
        sa.Column("memory_mb", sa.BigInteger(), nullable=False),
        sa.Column("max_sandboxes", sa.Integer(), nullable=False),
        _text("runsc_release"), _text("cpu_features"), _text("templates"), _text("metrics", server_default="'{}'"),
        _time("joined_at"), _time("lease_expires_at"),
        sa.PrimaryKeyConstraint("node_id", name="nodes_pkey"),
    )


def downgrade() -> None:
    op.drop_table("nodes")
    op.drop_index("teardowns_node_next", "teardowns")
    with op.batch_alter_table("teardowns") as batch:
        batch.drop_column("node_id")
