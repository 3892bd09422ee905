"""The sandbox package's rows (keepstate/sandbox/rows.py) through the database: a row, its typed settings and its
claim from the pool survive a restart (what re-adoption relies on), and so do snapshots (what the removed
tests/db/test_catalog.py checked of the catalog's sandboxes)."""

from __future__ import annotations

from keepstate.db.engine import Database
from keepstate.sandbox.record import Instance, SandboxRow, Settings
from keepstate.sandbox.rows import SandboxRows
from keepstate.sandbox.state import State


def row(sandbox_id: str, state: State, **settings: object) -> SandboxRow:
    return SandboxRow(sandbox_id=sandbox_id, state=state, template_id="base", template_digest="d",
                      runtime_name="ks-1", slot=3, address="10.88.0.14", access_token="tok" if settings else "",
                      started_at=1.0, end_at=302.0, cpu=2, memory_mb=512, settings=Settings(**settings))  # type: ignore[arg-type]


async def test_rows_and_snapshots_survive_a_restart(database: Database) -> None:
    rows = SandboxRows(database)
    await rows.put(row("pool-1", State.POOLED))
    mounts = [{"name": "data", "path": "/mnt/data", "volume_id": "vola"}]
    claimed = row("abc", State.RUNNING, session_id="abc", metadata={"a": "b"},
                  standby=Instance("ks-2", 4, "x", 5.0, 7), volume_mounts=mounts)
    await rows.claim("pool-1", claimed)
    await rows.put_snapshot("s1", ["n"], "CK", "abc", "base")

    again_db = await Database.open(database.url)  # what the next server opens
    try:
        again = SandboxRows(again_db)
        assert await again.get("pool-1") is None
        got = await again.get("abc")
        assert got is not None and got.settings == claimed.settings and got.runtime_name == "ks-1"
        assert got.state is State.RUNNING and got.settings.volume_mounts == mounts
        assert [r.sandbox_id for r in await again.list()] == ["abc"]
        assert [r.sandbox_id for r in await again.list((State.PAUSED,))] == []
        got.state = State.PAUSED
        await again.put(got)  # the next server writes the row it read
        assert (await rows.get("abc")).state is State.PAUSED  # type: ignore[union-attr]
        snap = await again.find_snapshot("s1")
        assert snap is not None and snap.names == ("n",) and snap.checkpoint_id == "CK"
        assert (await again.find_snapshot("n:latest")) == snap  # by a name:tag's name too
        assert await again.delete_snapshot("s1") and await again.snapshots() == []
    finally:
        await again_db.close()
