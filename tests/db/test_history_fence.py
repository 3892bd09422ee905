"""A session's history is extended only by the writer that holds its sandbox's row at the epoch it claims
(docs/design/cluster.md, "Fencing"), on SQLite and PostgreSQL: a stale epoch or another node's claim writes nothing,
in every kind of append; a writer without a claim (one host, a sandbox with no row any more) appends as before."""

from __future__ import annotations

import pytest

from keepstate.db.engine import Database
from keepstate.db.errors import Fenced
from keepstate.db.repos import History, Sandboxes

from .test_repos_history import event, link
from .test_repos_sandboxes import sandbox


async def test_appends_carry_the_writers_claim_and_a_stale_one_writes_nothing(database: Database) -> None:
    await Sandboxes(database).insert(sandbox("s1", node_id="b", epoch=3))
    claims: dict[str, tuple[str, str, int]] = {"s1": ("s1", "a", 2)}  # a's last view: before b took it over
    history = History(database, fence=claims.get)

    with pytest.raises(Fenced):
        await history.extend("s1", [link("s1")])
    with pytest.raises(Fenced):
        await history.append("s1", [event("s1", 1, "0" * 64)], expect_head=None)
    with pytest.raises(Fenced):
        assert await history.append_journal("s1", 0, [link("s1")], 5) is not None
    claims["s1"] = ("s1", "a", 3)  # the right epoch, the wrong node
    with pytest.raises(Fenced):
        await history.extend("s1", [link("s1")])
    assert await history.events("s1") == [] and await history.journal_cursor("s1") is None

    claims["s1"] = ("s1", "b", 3)  # the holder
    (written,) = await history.extend("s1", [link("s1")])
    assert written.seq == 1
    claims.pop("s1")  # no claim (a single host): as before
    (written,) = await history.extend("s1", [link("s1")])
    assert written.seq == 2
    claims["gone"] = ("gone", "a", 0)  # a claim on a sandbox whose row is deleted (its kill's last events)
    (written,) = await History(database, fence=claims.get).extend("gone", [link("gone")])
    assert written.seq == 1
