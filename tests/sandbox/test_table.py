"""The sandbox table's executor (keepstate/sandbox/table.py) on a real database, SQLite and PostgreSQL: the
transient state is written before a command acts, the success or failure state after; an illegal command writes
nothing; a hand-over ends in the next command's state; a failure-state write the database refuses is retried until
it lands; the freezer's try-lock gives way to a command; commands on one sandbox are serialised."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from keepstate.db.engine import Database
from keepstate.db.errors import DatabaseUnavailable
from keepstate.errors import Conflict, NotFound, Unavailable
from keepstate.sandbox import table as table_mod
from keepstate.sandbox.record import SandboxRow, Settings
from keepstate.sandbox.rows import SandboxRows
from keepstate.sandbox.state import Command, State
from keepstate.sandbox.table import SandboxTable
from keepstate.testing.databases import database, db_url, postgres  # noqa: F401


class FlakyRows(SandboxRows):
    """SandboxRows whose writes fail, as a database that went away, while `down` is set."""

    down = False

    async def put(self, row: SandboxRow) -> None:
        if self.down:
            raise DatabaseUnavailable("the database went away (test)")
        await super().put(row)


def row(sandbox_id: str, state: State) -> SandboxRow:
    return SandboxRow(sandbox_id=sandbox_id, state=state, template_id="base", template_digest="d",
                      runtime_name="ks-1", slot=3, address="10.88.0.14", access_token="tok", started_at=1.0,
                      end_at=302.0, cpu=2, memory_mb=512, settings=Settings(session_id=sandbox_id))


@pytest.fixture
async def table(database: Database) -> AsyncIterator[SandboxTable]:  # noqa: F811
    t = SandboxTable(FlakyRows(database))
    try:
        yield t
    finally:
        await t.close()


async def stored(t: SandboxTable, sandbox_id: str) -> State | None:
    got = await t.rows.get(sandbox_id)
    return got.state if got is not None else None


async def running(t: SandboxTable, sandbox_id: str = "sbx") -> SandboxRow:
    r = row(sandbox_id, State.RUNNING)
    await t.rows.put(r)
    t.enter(r)
    return r


async def test_the_transient_state_is_written_before_the_body_and_success_after(table: SandboxTable) -> None:
    await running(table)
    async with table.command("sbx", Command.PAUSE) as step:
        assert step.origin is State.RUNNING and step.row.state is State.PAUSING
        assert await stored(table, "sbx") is State.PAUSING  # what another server, or the next one, reads
        assert table.get("sbx").state is State.PAUSING and table.route("sbx") is None
    assert await stored(table, "sbx") is State.PAUSED and table.get("sbx").state is State.PAUSED


async def test_a_failing_body_leaves_the_failure_state_and_its_error(table: SandboxTable) -> None:
    await running(table)
    with pytest.raises(RuntimeError, match="capture failed"):
        async with table.command("sbx", Command.SNAPSHOT):
            raise RuntimeError("capture failed")
    assert table.get("sbx").state is State.RUNNING and await stored(table, "sbx") is State.RUNNING


async def test_an_illegal_command_and_a_refusing_admit_write_nothing(table: SandboxTable) -> None:
    await running(table)
    with pytest.raises(Conflict, match="not possible|already running"):
        async with table.command("sbx", Command.RESUME):
            pytest.fail("the body of an illegal command ran")
    seen: list[State] = []

    async def admit(r: SandboxRow) -> None:
        seen.append(r.state)
        raise Unavailable("no place for it")

    with pytest.raises(Unavailable):
        async with table.command("sbx", Command.PAUSE, admit=admit):
            pytest.fail("the body ran after admit refused")
    assert seen == [State.RUNNING]  # admit sees the state before the transient one
    assert await stored(table, "sbx") is State.RUNNING
    with pytest.raises(NotFound):
        async with table.command("nope", Command.KILL):
            pass


async def test_a_hand_over_ends_in_the_next_commands_state(table: SandboxTable) -> None:
    await running(table)
    async with table.command("sbx", Command.EXPIRE) as step, step.then(Command.KILL) as killing:
        assert killing.row.state is State.KILLING and await stored(table, "sbx") is State.KILLING
        await table.rows.delete("sbx")  # a kill deletes its row (with its teardown)
    assert "sbx" not in table and table.find("sbx") is None and await stored(table, "sbx") is None
    with pytest.raises(NotFound):
        table.get("sbx")

    await running(table, "two")
    with pytest.raises(RuntimeError):  # a failed hand-over: the next command's failure state, RUNNING
        async with table.command("two", Command.EXPIRE) as step, step.then(Command.PAUSE):
            raise RuntimeError("pause failed")
    assert table.get("two").state is State.RUNNING and await stored(table, "two") is State.RUNNING


async def test_a_failure_state_the_database_refuses_is_retried_until_it_lands(
        table: SandboxTable, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(table_mod, "RETRY_FIRST", 0.02)
    rows = table.rows
    assert isinstance(rows, FlakyRows)
    await running(table)
    with pytest.raises(RuntimeError, match="restore failed"):
        async with table.command("sbx", Command.PAUSE):
            rows.down = True  # the database goes away while the pause works
            raise RuntimeError("restore failed")
    assert table.get("sbx").state is State.RUNNING  # here at once
    assert await SandboxRows(rows.db).get("sbx") is not None
    assert (await SandboxRows(rows.db).get("sbx")).state is State.PAUSING  # type: ignore[union-attr]
    await asyncio.sleep(0.1)
    assert (await SandboxRows(rows.db).get("sbx")).state is State.PAUSING  # type: ignore[union-attr]
    rows.down = False
    for _ in range(200):
        if await stored(table, "sbx") is State.RUNNING:
            break
        await asyncio.sleep(0.02)
    assert await stored(table, "sbx") is State.RUNNING


async def test_a_transient_write_the_database_refuses_changes_nothing(table: SandboxTable) -> None:
    rows = table.rows
    assert isinstance(rows, FlakyRows)
    await running(table)
    rows.down = True
    with pytest.raises(DatabaseUnavailable):
        async with table.command("sbx", Command.PAUSE):
            pytest.fail("the body ran without its transient state written")
    rows.down = False
    assert table.get("sbx").state is State.RUNNING and await stored(table, "sbx") is State.RUNNING


async def test_commands_on_one_sandbox_are_serialised_and_the_try_lock_gives_way(table: SandboxTable) -> None:
    await running(table)
    inside, go = asyncio.Event(), asyncio.Event()
    order: list[str] = []

    async def pause() -> None:
        async with table.command("sbx", Command.PAUSE):
            order.append("pause")
            inside.set()
            await go.wait()

    async def kill() -> None:
        async with table.command("sbx", Command.KILL) as step:
            order.append(f"kill from {step.origin}")
            await table.rows.delete("sbx")

    paused = asyncio.create_task(pause())
    await inside.wait()
    killed = asyncio.create_task(kill())
    await asyncio.sleep(0.01)
    async with table.try_lock("sbx") as held:
        assert not held and table.command_running("sbx")
    go.set()
    await asyncio.gather(paused, killed)
    assert order == ["pause", "kill from paused"]  # the kill saw what the pause left
    async with table.try_lock("sbx") as held:
        assert held and table.command_running("sbx")
