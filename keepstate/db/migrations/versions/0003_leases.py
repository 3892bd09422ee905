"""Named leases, and when each paused sandbox was paused (docs/design/cluster.md, "Lifetimes and retention").

`leases`: one row per lease name (`store-gc`: one store collection at a time across the cluster), its holder, a token
that moves at every acquisition and its expiry by the database's clock. `sandboxes.paused_at`: when the row became
paused, by the database's clock, which `serve --paused-retention` is judged against. Rows already paused get none
here: the retention loop counts them from the first time it looks at them.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("paused_at", sa.Float(), nullable=True))
    op.create_table(
        "leases",
        sa.Column("name", sa.Text(), nullable=False), sa.Column("holder", sa.Text(), nullable=False),
        sa.Column("token", sa.BigInteger(), nullable=False), sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="leases_pkey"),
    )


def downgrade() -> None:
    op.drop_table("leases")
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("paused_at")
