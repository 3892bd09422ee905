"""Leases: a named lease one holder at a time has, judged by the database's clock (docs/design/cluster.md,
"Lifetimes and retention").

One row per name. `acquire` takes a lease that is free (released, expired or never taken) and gives the holder a
token that moves at every acquisition; only the holder with that token can `renew` it (while it has not expired)
or `release` it. A holder that could not renew in time has lost it: another may have taken it, and the token it
holds is stale from then on. Every expiry is the database's clock (`clock_timestamp()` on PostgreSQL,
`julianday('now')` on SQLite), never a node's.

    leases = Leases(db)
    token = await leases.acquire("store-gc", "node-a/5f2c", ttl_s=60)   # None: someone else holds it
    await leases.renew("store-gc", "node-a/5f2c", token, ttl_s=60)      # None: lost it
    await leases.release("store-gc", "node-a/5f2c", token)
"""

from __future__ import annotations

import sqlalchemy as sa

from keepstate.db.engine import Database
from keepstate.db.records import LeaseRecord
from keepstate.db.repos._sql import insert_or_ignore, record
from keepstate.db.repos.nodes import db_now
from keepstate.db.schema import leases

_c = leases.c


class Leases:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def acquire(self, name: str, holder: str, ttl_s: float) -> int | None:
        """Take the lease `name` for `ttl_s` seconds if nobody holds it (released, expired, or never taken): its new
        token. None if another holder has it (the same holder acquiring again gets None too: it holds it)."""
        if not holder:
            raise ValueError("a lease's holder must be named")
        now = db_now(self.db.kind)
        async with self.db.transaction() as conn:
            await conn.execute(insert_or_ignore(self.db.kind, leases, ["name"],
                                                {"name": name, "holder": "", "token": 0, "expires_at": 0.0}))
            done = await conn.execute(
                leases.update().where(_c.name == name, sa.or_(_c.holder == "", _c.expires_at <= now))
                .values(holder=holder, token=_c.token + 1, expires_at=now + ttl_s).returning(_c.token))
            token = done.scalar_one_or_none()
        return int(token) if token is not None else None

    async def renew(self, name: str, holder: str, token: int, ttl_s: float) -> float | None:
        """Extend the lease to the database's now + `ttl_s` if this holder still has it by this token and it has not
        expired: the new expiry. None: it is lost (expired, released, or taken by another acquisition)."""
        now = db_now(self.db.kind)
        async with self.db.transaction() as conn:
            done = await conn.execute(
                leases.update().where(_c.name == name, _c.holder == holder, _c.token == token, _c.expires_at > now)
                .values(expires_at=now + ttl_s).returning(_c.expires_at))
            expires = done.scalar_one_or_none()
        return float(expires) if expires is not None else None

    async def release(self, name: str, holder: str, token: int) -> bool:
        """Give the lease up now (the next `acquire` gets it). False if this holder's token no longer holds it."""
        async with self.db.transaction() as conn:
            done = await conn.execute(
                leases.update().where(_c.name == name, _c.holder == holder, _c.token == token)
                .values(holder="", expires_at=db_now(self.db.kind)))
            return done.rowcount == 1

    async def get(self, name: str) -> LeaseRecord | None:
        """The lease as it stands (None: never taken)."""
        async with self.db.read() as conn:
            row = (await conn.execute(sa.select(leases).where(_c.name == name))).first()
        return record(LeaseRecord, row) if row is not None else None
