"""Templates on SQLite and PostgreSQL: a name is unique; a build is published (status, tags, template's time, its
layer) in one transaction; deleting a template takes its builds and tags; layers by cache key and by checkpoint."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import sqlalchemy as sa

from keepstate.db.engine import Database
from keepstate.db.records import BuildRecord, LayerRecord, TemplateRecord
from keepstate.db.repos import Templates
from keepstate.errors import Conflict, NotFound

from .race import HeldCommit, race


def template(template_id: str, name: str, created_at: float = 1.0) -> TemplateRecord:
    return TemplateRecord(template_id=template_id, name=name, cpu=2, memory_mb=512, created_at=created_at,
                          updated_at=created_at)


def build(build_id: str, template_id: str = "t1", created_at: float = 1.0,
          reason: dict[str, Any] | None = None) -> BuildRecord:
    return BuildRecord(build_id=build_id, template_id=template_id, status="waiting", created_at=created_at,
                       reason=reason)


def ready(b: BuildRecord, checkpoint_id: str) -> BuildRecord:
    return dataclasses.replace(b, status="ready", checkpoint_id=checkpoint_id, sandbox_id="sb-build",
                               finished_at=b.created_at + 10)


async def test_put_get_list_update_templates(database: Database) -> None:
    repo = Templates(database)
    a, b = template("t1", "app", 2.0), template("t2", "web", 1.0)
    await repo.put_template(a)
    await repo.put_template(b)
    assert await repo.get_template("t1") == a and await repo.get_template("app") == a  # by ID or by name
    assert await repo.get_template("nope") is None
    assert await repo.templates() == [b, a]
    assert await repo.update_template("t1", 4, 2048) is True
    got = await repo.get_template("app")
    assert got is not None and (got.cpu, got.memory_mb, got.created_at) == (4, 2048, 2.0) and got.updated_at > 2.0
    assert await repo.update_template("nope", 1, 1) is False


async def test_an_id_wins_over_another_templates_name(database: Database) -> None:
    repo = Templates(database)
    await repo.put_template(template("zz", "t1"))
    await repo.put_template(template("t1", "other"))
    assert (await repo.get_template("t1")).name == "other"  # type: ignore[union-attr]
    assert (await repo.get_template("zz")).name == "t1"  # type: ignore[union-attr]


async def test_a_name_is_unique(database: Database) -> None:
    repo = Templates(database)
    await repo.put_template(template("t1", "app"))
    with pytest.raises(Conflict, match="a template named 'app' exists"):
        await repo.put_template(template("t2", "app"))
    with pytest.raises(Conflict):
        await repo.put_template(template("t1", "other"))  # its ID is taken
    assert [t.template_id for t in await repo.templates()] == ["t1"]


async def test_two_racing_creates_of_one_name_one_conflicts(database: Database, held_database: HeldCommit) -> None:
    outcomes = await race(held_database,
                          lambda: Templates(held_database).put_template(template("t1", "app")),
                          lambda: Templates(database).put_template(template("t2", "app")))
    assert outcomes[0] is None and isinstance(outcomes[1], Conflict)
    assert [t.template_id for t in await Templates(database).templates()] == ["t1"]


async def test_put_get_list_builds(database: Database) -> None:
    repo = Templates(database)
    b1 = build("b1", created_at=2.0, reason={"tags": ["default", "v1"]})
    b2 = build("b2", "t2", created_at=1.0)
    await repo.put_build(b1)
    await repo.put_build(b2)
    assert await repo.get_build("b1") == b1 and await repo.get_build("nope") is None  # the reason comes back decoded
    assert await repo.builds() == [b2, b1]
    assert await repo.builds("t1") == [b1] and await repo.builds("nope") == []
    # Writing it again changes its status, checkpoint, sandbox, reason and finish, never its template or creation.
    failed = dataclasses.replace(b1, template_id="other", created_at=9.0, status="error", checkpoint_id="ck",
                                 sandbox_id="sb", reason={"message": "boom", "step": "2"}, finished_at=5.0)
    await repo.put_build(failed)
    assert await repo.get_build("b1") == dataclasses.replace(failed, template_id="t1", created_at=2.0)
    await repo.put_build(dataclasses.replace(failed, reason=None))
    assert (await repo.get_build("b1")).reason is None  # type: ignore[union-attr]


async def test_publish_moves_the_tags_and_touches_the_template_in_one_transaction(database: Database) -> None:
    repo = Templates(database)
    await repo.put_template(template("t1", "app"))
    old, new = build("b1", reason={"tags": ["default"]}), build("b2", created_at=2.0, reason={"tags": ["default"]})
    await repo.put_build(old)
    await repo.put_build(new)
    await repo.publish_build(ready(old, "ck1"), ["default", "v1"])
    assert await repo.tag_build("t1", "default") == "b1" and await repo.tag_build("t1", "v1") == "b1"
    published = await repo.get_build("b1")
    assert published == dataclasses.replace(ready(old, "ck1"), reason=None)  # the reason is cleared
    assert (await repo.get_template("t1")).updated_at > 1.0  # type: ignore[union-attr]
    layer = LayerRecord(cache_key="build:b2", checkpoint_id="ck2", state={"user": "root", "env": {"A": "1"}})
    await repo.publish_build(ready(new, "ck2"), ["default", "v2", "v2"], layer)
    assert await repo.tag_build("t1", "default") == "b2" and await repo.tag_build("t1", "v1") == "b1"
    assert [(t.tag, t.build_id) for t in await repo.tags("t1")] == [("v1", "b1"), ("default", "b2"), ("v2", "b2")]
    assert await repo.tagged_build("t1", "v2") == dataclasses.replace(ready(new, "ck2"), reason=None)
    assert await repo.tagged_build("t1", "nope") is None and await repo.tag_build("t1", "nope") is None
    got = await repo.get_layer("build:b2")
    assert got is not None and (got.checkpoint_id, got.state) == ("ck2", layer.state) and got.created_at > 0


async def test_publishing_a_build_that_is_gone_writes_nothing(database: Database) -> None:
    repo = Templates(database)
    await repo.put_template(template("t1", "app"))
    before = await repo.get_template("t1")
    layer = LayerRecord(cache_key="build:b1", checkpoint_id="ck1")
    with pytest.raises(NotFound):
        await repo.publish_build(ready(build("b1"), "ck1"), ["default"], layer)
    assert await repo.tags("t1") == [] and await repo.get_layer("build:b1") is None
    assert await repo.get_template("t1") == before


async def test_a_failing_publish_leaves_everything_as_it_was(database: Database) -> None:
    """A statement of the publish that fails (here: a tag's NOT NULL) rolls back the build's status written
    before it: a create never sees a ready build whose tags did not move."""
    repo = Templates(database)
    await repo.put_template(template("t1", "app"))
    await repo.put_build(build("b1"))
    with pytest.raises(sa.exc.IntegrityError):
        await repo.publish_build(ready(build("b1"), "ck1"), ["default", None])  # type: ignore[list-item]
    assert (await repo.get_build("b1")).status == "waiting"  # type: ignore[union-attr]
    assert await repo.tags("t1") == []


async def test_two_publishes_of_one_tag_the_last_to_commit_wins(database: Database,
                                                                 held_database: HeldCommit) -> None:
    repo = Templates(database)
    await repo.put_template(template("t1", "app"))
    await repo.put_build(build("b1"))
    await repo.put_build(build("b2"))
    outcomes = await race(held_database,
                          lambda: Templates(held_database).publish_build(ready(build("b1"), "ck1"), ["default"]),
                          lambda: repo.publish_build(ready(build("b2"), "ck2"), ["default", "v2"]))
    assert outcomes == [None, None]
    assert await repo.tag_build("t1", "default") == "b2" and await repo.tag_build("t1", "v2") == "b2"
    assert [(t.tag, t.build_id) for t in await repo.tags("t1")] == [("default", "b2"), ("v2", "b2")]
    assert {b.build_id: b.status for b in await repo.builds("t1")} == {"b1": "ready", "b2": "ready"}


async def test_set_and_delete_tags(database: Database) -> None:
    repo = Templates(database)
    await repo.set_tag("t1", "stable", "b1")
    await repo.set_tag("t1", "stable", "b2")  # moved
    await repo.set_tag("t2", "stable", "b3")  # another template's tag of the same name
    assert await repo.tag_build("t1", "stable") == "b2" and await repo.tag_build("t2", "stable") == "b3"
    assert await repo.delete_tag("t1", "stable") is True and await repo.delete_tag("t1", "stable") is False
    assert await repo.tags("t1") == [] and await repo.tag_build("t2", "stable") == "b3"


async def test_delete_template_takes_its_builds_and_tags_and_names_its_checkpoints(database: Database) -> None:
    repo = Templates(database)
    for t in (template("t1", "app"), template("t2", "web")):
        await repo.put_template(t)
    await repo.put_build(build("b1"))
    await repo.put_build(build("b2", created_at=2.0))
    await repo.put_build(build("b3", "t2"))
    await repo.publish_build(ready(build("b1"), "ck1"), ["default"])
    await repo.publish_build(ready(build("b3", "t2"), "ck3"), ["default"])
    await repo.put_layer("build:b1", "ck1", {})
    assert await repo.delete_template("t1") == ["ck1"]  # b2 held none
    assert await repo.get_template("app") is None and await repo.builds("t1") == [] and await repo.tags("t1") == []
    assert await repo.get_layer("build:b1") is not None  # layers stay: other templates may start from them
    assert [b.build_id for b in await repo.builds()] == ["b3"] and await repo.tag_build("t2", "default") == "b3"
    assert await repo.delete_template("t1") == []
    await repo.put_template(template("t4", "app"))  # the name is free again


async def test_layers_by_cache_key_and_by_checkpoint(database: Database) -> None:
    repo = Templates(database)
    await repo.put_layer("k1", "ck1", {"user": "root"})
    await repo.put_layer("k2", "ck1", {})
    await repo.put_layer("k3", "ck2", {"workdir": "/w"})
    got = await repo.get_layer("k1")
    assert got is not None and (got.cache_key, got.checkpoint_id, got.state) == ("k1", "ck1", {"user": "root"})
    assert await repo.get_layer("nope") is None
    await repo.put_layer("k1", "ck9", {"user": "u"})  # replaced
    got = await repo.get_layer("k1")
    assert got is not None and (got.checkpoint_id, got.state) == ("ck9", {"user": "u"})
    assert [la.cache_key for la in await repo.layers_of("ck1")] == ["k2"]
    assert sorted(la.cache_key for la in await repo.layers()) == ["k1", "k2", "k3"]
    assert await repo.delete_layers_of("ck2") == ["k3"] and await repo.delete_layers_of("ck2") == []
    assert await repo.delete_layer("k1") is True and await repo.delete_layer("k1") is False
    assert [la.cache_key for la in await repo.layers()] == ["k2"]
