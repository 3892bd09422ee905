"""Directory watches through the stock SDK: sync (CreateWatcher polling) and async (WatchDir stream)."""

from __future__ import annotations

import asyncio

import pytest
from e2b import FilesystemEventType, InvalidArgumentException, NotFoundException

from tests.agent.harness import eventually


def test_watch_sync_upload_yields_create_chmod_write(sandbox, home_dir) -> None:
    sandbox.files.make_dir(home_dir)
    handle = sandbox.files.watch_dir(home_dir)
    sandbox.files.write(f"{home_dir}/f.txt", "hello")
    events = []
    assert eventually(lambda: bool(events.extend(handle.get_new_events()) or len(events) >= 3))
    assert [(e.name, e.type) for e in events] == [
        ("f.txt", FilesystemEventType.CREATE),
        ("f.txt", FilesystemEventType.CHMOD),
        ("f.txt", FilesystemEventType.WRITE),
    ]
    sandbox.files.remove(f"{home_dir}/f.txt")
    more = []
    assert eventually(lambda: bool(more.extend(handle.get_new_events()) or more))
    assert (more[0].name, more[0].type) == ("f.txt", FilesystemEventType.REMOVE)
    handle.stop()


def test_watch_sync_recursive_new_subdir(sandbox, home_dir) -> None:
    sandbox.files.make_dir(home_dir)
    handle = sandbox.files.watch_dir(home_dir, recursive=True)
    sandbox.files.make_dir(f"{home_dir}/nested")
    sandbox.files.write(f"{home_dir}/nested/file.txt", "x")
    events = []
    assert eventually(lambda: bool(events.extend(handle.get_new_events()) or
                                   any(e.name == "nested/file.txt" for e in events)))
    names = [(e.name, e.type) for e in events]
    assert names[0] == ("nested", FilesystemEventType.CREATE)
    assert ("nested/file.txt", FilesystemEventType.CREATE) in names
    handle.stop()


def test_watch_rename_and_chmod_with_entry(sandbox, home_dir) -> None:
    if "include_entry" not in sandbox.files.watch_dir.__code__.co_varnames:
        pytest.skip("this SDK has no include_entry")
    sandbox.files.write(f"{home_dir}/a.txt", "a")
    handle = sandbox.files.watch_dir(home_dir, include_entry=True)
    # The entry is what the path holds when the event is delivered: the chmod's is read before the file moves
    # (one command doing both raced the move, and the chmod's entry was sometimes gone).
    sandbox.commands.run(f"chmod 600 {home_dir}/a.txt")
    events = []
    assert eventually(lambda: bool(events.extend(handle.get_new_events()) or len(events) >= 1))
    sandbox.commands.run(f"mv {home_dir}/a.txt {home_dir}/b.txt")
    assert eventually(lambda: bool(events.extend(handle.get_new_events()) or len(events) >= 3))
    kinds = [(e.name, e.type) for e in events]
    assert kinds[:3] == [("a.txt", FilesystemEventType.CHMOD), ("a.txt", FilesystemEventType.RENAME),
                         ("b.txt", FilesystemEventType.CREATE)]
    assert events[0].entry is not None and events[0].entry.mode == 0o600
    handle.stop()


def test_watch_errors(sandbox, home_dir) -> None:
    with pytest.raises(NotFoundException):
        sandbox.files.watch_dir(f"{home_dir}/missing")
    sandbox.files.write(f"{home_dir}/file", "f")
    with pytest.raises(InvalidArgumentException):
        sandbox.files.watch_dir(f"{home_dir}/file")


async def test_watch_async_recursive(async_sandbox, home_dir) -> None:
    await async_sandbox.files.make_dir(home_dir)
    seen = []
    got_file = asyncio.Event()

    def on_event(event) -> None:  # type: ignore[no-untyped-def]
        seen.append((event.name, event.type))
        if event.name == "sub/deeper/f.txt" and event.type == FilesystemEventType.WRITE:
            got_file.set()

    handle = await async_sandbox.files.watch_dir(home_dir, on_event=on_event, recursive=True)
    await async_sandbox.files.make_dir(f"{home_dir}/sub/deeper")
    await async_sandbox.files.write(f"{home_dir}/sub/deeper/f.txt", "deep")
    await asyncio.wait_for(got_file.wait(), 10)
    await handle.stop()
    assert ("sub", FilesystemEventType.CREATE) in seen
    assert ("sub/deeper/f.txt", FilesystemEventType.CREATE) in seen
