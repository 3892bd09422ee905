"""Lineage: sessions, checkpoints and forks as a tree."""

from __future__ import annotations

import pytest

from keepstate.errors import BadRequest, NotFound
from keepstate.session import EventRef, Lineage


async def _family(lineage: Lineage) -> None:
    await lineage.record_session("root", "base", created=1.0)
    await lineage.record_checkpoint("c1", "root", None, "snapshot", EventRef(3, "a" * 64), created=2.0)
    await lineage.record_checkpoint("c2", "root", "c1", "pause", EventRef(5, "b" * 64), journal_cursor=9, created=3.0)
    for i, name in enumerate(["f1", "f2"]):
        await lineage.record_session(name, "base", parent_session="root", parent_checkpoint_id="c2", created=4.0 + i)
    await lineage.record_checkpoint("c3", "f1", "c2", "fork", EventRef(2, "c" * 64), created=6.0)
    await lineage.record_session("g1", "base", parent_session="f1", parent_checkpoint_id="c3", created=7.0)


async def test_tree_from_any_member_shows_the_whole_lineage(lineage: Lineage) -> None:
    await _family(lineage)
    tree = await lineage.tree("g1")
    assert tree["rootSessionId"] == "root" and tree["sessionId"] == "g1"
    root = tree["root"]
    assert [c["checkpointId"] for c in root["checkpoints"]] == ["c1", "c2"]
    c2 = root["checkpoints"][1]
    assert c2["parentCheckpointId"] == "c1" and c2["event"] == {"seq": 5, "hash": "b" * 64}
    assert [f["sessionId"] for f in c2["forks"]] == ["f1", "f2"]
    f1 = c2["forks"][0]
    assert f1["parentSessionId"] == "root" and f1["parentCheckpointId"] == "c2"
    assert [g["sessionId"] for g in f1["checkpoints"][0]["forks"]] == ["g1"]
    assert root["checkpoints"][0]["forks"] == [] and root["forks"] == []
    assert (await lineage.tree("root"))["root"] == root


async def test_queries(lineage: Lineage) -> None:
    await _family(lineage)
    assert await lineage.forks_of("c2") == ["f1", "f2"] and await lineage.forks_of("c1") == []
    latest = await lineage.latest_checkpoint("root")
    assert latest is not None and latest.checkpoint_id == "c2" and latest.journal_cursor == 9
    assert await lineage.latest_checkpoint("f2") is None
    await lineage.set_state("f2", "paused")
    assert (await lineage.session("f2")).state == "paused"  # type: ignore[union-attr]
    # a fork whose parent checkpoint was deleted stays in the tree, under its session
    assert await lineage.forget_checkpoint("c3")
    tree = await lineage.tree("root")
    assert [f["sessionId"] for f in tree["root"]["checkpoints"][1]["forks"][0]["forks"]] == ["g1"]


async def test_errors(lineage: Lineage) -> None:
    with pytest.raises(NotFound):
        await lineage.tree("nobody")
    with pytest.raises(BadRequest):
        await lineage.record_checkpoint("c", "s", None, "weird", None)
    with pytest.raises(BadRequest):
        await lineage.record_session("s", parent_session="p")
    with pytest.raises(NotFound):
        await lineage.set_state("nobody", "killed")
