"""Idempotent creates (docs/design/idempotency.md): one row per (API key, Idempotency-Key), with the request's digest,
the sandbox ID chosen before the create ran, its state and owner, and the answer once done. And
`sandboxes.resume_pending`: a paused sandbox handed to a node by one that stopped with `--on-stop handover`, which
its new node resumes at once (docs/design/cluster.md).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "idempotency",
        sa.Column("api_key_id", sa.Text(), nullable=False), sa.Column("key", sa.Text(), nullable=False),
        sa.Column("digest", sa.Text(), nullable=False), sa.Column("sandbox_id", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False), sa.Column("owner", sa.Text(), nullable=False),
        sa.Column("response", sa.Text(), nullable=True), sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("api_key_id", "key", name="idempotency_pkey"),
    )
    op.create_index("idempotency_expires", "idempotency", ["expires_at"])
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("resume_pending", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("resume_pending")
    op.drop_index("idempotency_expires", table_name="idempotency")
    op.drop_table("idempotency")
