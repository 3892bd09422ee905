"""The gateway ledger's claims on calls (used by keepstate/db/repos/ledger.py): who owns a call in flight and whether
that owner is gone, which budgets a call reserves on, and what a reservation becomes when the call ends.

An owner is an opaque string written on `calls.owner` and `reservations.owner`, of one of two kinds:
- **a node's incarnation**, `node/<node id>/<incarnation>` (`node_owner`): the gateway of a `keepstate serve`. It is
  gone once that incarnation no longer holds its `nodes` row (the node left, was declared dead or removed, or
  joined again as a newer incarnation). That is a fact of the shared database, the same for every node that asks,
  and final: an incarnation that lost its row never holds it again (Nodes.join moves `incarnation` on, and only the
  holder of a row in a live state renews it). So a node may take a gone owner's call over without locking `nodes`.
- **anything else** (`pid:nonce`, a standalone `keepstate gateway` process): whether it is alive is the caller's to
  say (`alive`), as only the host that runs it can.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from keepstate.db.engine import Conn
from keepstate.db.repos.nodes import LIVE
from keepstate.db.schema import budgets, nodes, reservations

NODE_PREFIX = "node/"

_LIVE_INCARNATION = sa.select(nodes.c.incarnation).where(
    nodes.c.node_id == sa.bindparam("node_id"), nodes.c.incarnation == sa.bindparam("incarnation"),
    nodes.c.state.in_(LIVE))
_LIVE_INCARNATIONS = sa.select(nodes.c.node_id, nodes.c.incarnation).where(nodes.c.state.in_(LIVE))
_RESERVATIONS = (sa.select(reservations).where(reservations.c.call_key == sa.bindparam("call_key"),
                                               reservations.c.owner == sa.bindparam("owner"))
                 .order_by(reservations.c.id))
_BUDGETS_1 = sa.select(budgets.c.scope, budgets.c.ident).where(
    budgets.c.scope == sa.bindparam("s0"), budgets.c.ident == sa.bindparam("i0"))
_BUDGETS_2 = sa.select(budgets.c.scope, budgets.c.ident).where(sa.or_(
    sa.and_(budgets.c.scope == sa.bindparam("s0"), budgets.c.ident == sa.bindparam("i0")),
    sa.and_(budgets.c.scope == sa.bindparam("s1"), budgets.c.ident == sa.bindparam("i1"))))


# -- owners ---------------------------------------------------------------------------------------------------------
def node_owner(node_id: str, incarnation: int) -> str:
    """The owner a node's gateway writes on the calls it claims while `incarnation` of `node_id` holds its lease."""
    return f"{NODE_PREFIX}{node_id}/{incarnation}"


def node_of(owner: str) -> tuple[str, int] | None:
    """The node and incarnation a node owner names; None for any other owner."""
    if not owner.startswith(NODE_PREFIX):
        return None
    node_id, _, incarnation = owner[len(NODE_PREFIX):].rpartition("/")
    return (node_id, int(incarnation)) if node_id and incarnation.isdigit() else None


async def owner_gone(conn: Conn, owner: str, alive: Callable[[str], bool]) -> bool:
    """Whether the owner of a call in flight is gone: for a node owner, by the `nodes` table (one indexed read);
    for any other, by `alive`."""
    node = node_of(owner)
    if node is None:
        return not alive(owner)
    found = (await conn.execute(_LIVE_INCARNATION, {"node_id": node[0], "incarnation": node[1]})).first()
    return found is None


async def gone_judge(conn: Conn, alive: Callable[[str], bool]) -> Callable[[str], bool]:
    """`owner_gone` for many owners at once: the live incarnations read once."""
    live = {node_owner(r.node_id, int(r.incarnation)) for r in await conn.execute(_LIVE_INCARNATIONS)}

    def gone(owner: str) -> bool:
        return owner not in live if node_of(owner) is not None else not alive(owner)

    return gone


# -- budgets and reservations ---------------------------------------------------------------------------------------
async def existing_budgets(conn: Conn, scopes: Sequence[tuple[str, str]]) -> builtins.list[tuple[str, str]]:
    """The scopes of `scopes` that have a budget, in their order."""
    if not scopes:
        return []
    found = {(r.scope, r.ident) for r in await conn.execute(*_budgets_of(scopes))}
    return [s for s in scopes if s in found]


def _budgets_of(scopes: Sequence[tuple[str, str]]) -> tuple[sa.Select[Any], dict[str, str]]:
    """The statement (and its parameters) reading which budgets of `scopes` exist: for a call's one or two scopes,
    one of two statements built once."""
    if len(scopes) == 1:
        return _BUDGETS_1, {"s0": scopes[0][0], "i0": scopes[0][1]}
    if len(scopes) == 2:
        return _BUDGETS_2, {"s0": scopes[0][0], "i0": scopes[0][1], "s1": scopes[1][0], "i1": scopes[1][1]}
    where = sa.or_(*(sa.and_(budgets.c.scope == scope, budgets.c.ident == ident) for scope, ident in scopes))
    return sa.select(budgets.c.scope, budgets.c.ident).where(where), {}


async def reserve(conn: Conn, call_key: str, owner: str, scope: str, ident: str, amount: int) -> bool:
    """Reserve `amount` on the budget of `scope` `ident` for `owner`'s call, by one conditional UPDATE (`spent +
    reserved + amount <= limit`: two reservations at once, from any node, never overspend it). False if the budget
    would be overrun; True if reserved, or if there is no such budget (nothing to reserve)."""
    where = (budgets.c.scope == scope, budgets.c.ident == ident)
    done = await conn.execute(
        budgets.update()
        .where(*where, budgets.c.spent_nano + budgets.c.reserved_nano + amount <= budgets.c.limit_nano)
        .values(reserved_nano=budgets.c.reserved_nano + amount))
    if done.rowcount != 1:
        return (await conn.execute(sa.select(budgets.c.scope).where(*where))).first() is None
    await conn.execute(reservations.insert().values(call_key=call_key, owner=owner, scope=scope, ident=ident,
                                                    amount_nano=amount))
    return True


async def settle(conn: Conn, call_key: str, owner: str, cost_nano: int | None) -> None:
    """Replace the call's reservations by `owner` with its actual cost (None: charge the whole reservation)."""
    rows = (await conn.execute(_RESERVATIONS, {"call_key": call_key, "owner": owner})).all()
    for r in rows:
        spent = r.amount_nano if cost_nano is None else cost_nano
        await conn.execute(
            budgets.update().where(budgets.c.scope == r.scope, budgets.c.ident == r.ident)
            .values(reserved_nano=budgets.c.reserved_nano - r.amount_nano, spent_nano=budgets.c.spent_nano + spent))
        await conn.execute(reservations.delete().where(reservations.c.id == r.id))
