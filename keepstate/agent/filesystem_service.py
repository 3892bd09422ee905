"""The `filesystem.Filesystem` Connect service."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import stat
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from keepstate.agent.entry import entry_info
from keepstate.agent.journal import Journal
from keepstate.agent.permissions import (
    Identity,
    PermissionDenied,
    R,
    X,
    allowed,
    check_create,
    check_list,
    check_move,
    check_remove,
    check_stat,
    for_user,
)
from keepstate.agent.proto.filesystem.filesystem_connect import Filesystem
from keepstate.agent.proto.filesystem.filesystem_pb import (
    CreateWatcherRequest,
    CreateWatcherResponse,
    EntryInfo,
    FilesystemEvent,
    GetWatcherEventsRequest,
    GetWatcherEventsResponse,
    ListDirRequest,
    ListDirResponse,
    MakeDirRequest,
    MakeDirResponse,
    MoveRequest,
    MoveResponse,
    RemoveRequest,
    RemoveResponse,
    RemoveWatcherRequest,
    RemoveWatcherResponse,
    StatRequest,
    StatResponse,
    WatchDirRequest,
    WatchDirResponse,
)
from keepstate.agent.rpc_context import keepalive_interval, request_path, request_user
from keepstate.agent.settings import SandboxSettings
from keepstate.agent.users import User, make_dirs_for
from keepstate.agent.watcher import DirWatcher, is_network_mount

# Each Oneof is given its member type first: mypy infers Oneof("start", ...) as Oneof[str, ...] against the
# generated union of one Oneof[Literal[field], value] per field.
_KEEPALIVE_EVENT: Oneof[Literal["keepalive"], WatchDirResponse.KeepAlive] = Oneof("keepalive",
                                                                                 WatchDirResponse.KeepAlive())
_KEEPALIVE = WatchDirResponse(event=_KEEPALIVE_EVENT)
MAX_BUFFERED_EVENTS = 10_000  # per CreateWatcher watcher, for a client that stopped polling


def _os_error(e: OSError, path: str) -> ConnectError:
    if e.errno == errno.ENOENT:
        return ConnectError(Code.NOT_FOUND, f"path '{path}' does not exist")
    if e.errno in (errno.EACCES, errno.EPERM):
        return ConnectError(Code.PERMISSION_DENIED, f"permission denied: '{path}'")
    if e.errno == errno.ENOTDIR:
        return ConnectError(Code.INVALID_ARGUMENT, f"path '{path}' is not a directory")
    if e.errno == errno.ENOSPC:
        return ConnectError(Code.RESOURCE_EXHAUSTED, "not enough disk space")
    return ConnectError(Code.INTERNAL, f"{e.strerror or e}: '{path}'")


def walk_entries(root: str, display_root: str, depth: int, who: Identity | None = None) -> Iterator[EntryInfo]:
    """Pre-order, lexically sorted per directory, excluding the root, at most `depth` levels deep.
    Symlinked directories are reported but not descended into, nor are those `who` may not list (like `find`)."""
    def visit(real_dir: str, shown_dir: str, level: int) -> Iterator[EntryInfo]:
        try:
            names = sorted(os.listdir(real_dir))
        except OSError:
            return
        for name in names:
            real, shown = os.path.join(real_dir, name), os.path.join(shown_dir, name)
            try:
                info = entry_info(real, shown)
                is_dir = stat.S_ISDIR(os.lstat(real).st_mode)
            except OSError:
                continue  # removed while listing
            yield info
            if is_dir and level < depth and (who is None or _may_list(real, who)):
                yield from visit(real, shown, level + 1)

    yield from visit(root, display_root, 1)


def _may_list(path: str, who: Identity) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return allowed(st.st_mode, st.st_uid, st.st_gid, who, R | X)


class _PolledWatcher:
    """A CreateWatcher watcher: events buffered until the next GetWatcherEvents."""

    def __init__(self) -> None:
        self.watcher: DirWatcher | None = None  # set once the watch is open; events may arrive first
        self.events: list[FilesystemEvent] = []

    def add(self, event: FilesystemEvent) -> None:
        if len(self.events) < MAX_BUFFERED_EVENTS:
            self.events.append(event)


class FilesystemService(Filesystem):
    def __init__(self, settings: SandboxSettings, journal: Journal | None = None) -> None:
        self._settings = settings
        self._journal = journal or Journal()
        self._watchers: dict[str, _PolledWatcher] = {}

    def watching(self) -> int:
        """How many watchers (CreateWatcher) collect events for a client (the host does not freeze it meanwhile)."""
        return len(self._watchers)

    def _user_path(self, path: str, ctx: Any, check: Callable[[str, Identity], None]) -> tuple[User, str]:
        """The request's user and resolved path, once `check` says that user may do this to it."""
        user = request_user(self._settings, ctx)
        resolved = request_path(self._settings, path, user)
        try:
            check(resolved, for_user(user.name, user.uid, user.gid))
        except PermissionDenied as e:
            raise ConnectError(Code.PERMISSION_DENIED, str(e)) from None
        return user, resolved

    async def stat(self, request: StatRequest, ctx: Any) -> StatResponse:
        _, path = self._user_path(request.path, ctx, check_stat)
        try:
            return StatResponse(entry=entry_info(path))
        except OSError as e:
            raise _os_error(e, path) from None

    async def make_dir(self, request: MakeDirRequest, ctx: Any) -> MakeDirResponse:
        user, path = self._user_path(request.path, ctx, check_create)
        try:
            if os.path.lexists(path):
                if os.path.isdir(path):
                    raise ConnectError(Code.ALREADY_EXISTS, f"directory '{path}' already exists")
                raise ConnectError(Code.INVALID_ARGUMENT, f"path '{path}' already exists and is not a directory")
            make_dirs_for(path, user)
            self._journal.append("dir.make", {"path": path})
            return MakeDirResponse(entry=entry_info(path))
        except OSError as e:
            raise _os_error(e, path) from None

    async def move(self, request: MoveRequest, ctx: Any) -> MoveResponse:
        user, source = self._user_path(request.source, ctx, lambda path, who: None)
        destination = request_path(self._settings, request.destination, user)
        try:
            check_move(source, destination, for_user(user.name, user.uid, user.gid))
        except PermissionDenied as e:
            raise ConnectError(Code.PERMISSION_DENIED, str(e)) from None
        if not os.path.lexists(source):
            raise ConnectError(Code.NOT_FOUND, f"source '{source}' does not exist")
        try:
            make_dirs_for(os.path.dirname(destination), user)
            try:
                os.rename(source, destination)
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
                shutil.move(source, destination)
            self._journal.append("file.move", {"source": source, "destination": destination})
            return MoveResponse(entry=entry_info(destination))
        except OSError as e:
            raise _os_error(e, destination) from None

    async def list_dir(self, request: ListDirRequest, ctx: Any) -> ListDirResponse:
        user, path = self._user_path(request.path, ctx, check_list)
        try:
            st = os.stat(path)  # follows a symlinked dir, like envd
        except OSError as e:
            raise _os_error(e, path) from None
        if not stat.S_ISDIR(st.st_mode):
            raise ConnectError(Code.INVALID_ARGUMENT, f"path '{path}' is not a directory")
        real = os.path.realpath(path)
        who = for_user(user.name, user.uid, user.gid)
        return ListDirResponse(entries=list(walk_entries(real, path, max(request.depth, 1), who)))

    async def remove(self, request: RemoveRequest, ctx: Any) -> RemoveResponse:
        _, path = self._user_path(request.path, ctx, check_remove)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            return RemoveResponse()  # removing what is not there is not an error (nor an action)
        except OSError as e:
            raise _os_error(e, path) from None
        self._journal.append("file.remove", {"path": path})
        return RemoveResponse()

    def _open_watch(self, request: WatchDirRequest | CreateWatcherRequest, ctx: Any, sink: Any) -> DirWatcher:
        _, path = self._user_path(request.path, ctx, check_list)
        try:
            st = os.stat(path)
        except OSError as e:
            raise _os_error(e, path) from None
        if not stat.S_ISDIR(st.st_mode):
            raise ConnectError(Code.INVALID_ARGUMENT, f"path '{path}' is not a directory")
        if not request.allow_network_mounts and is_network_mount(os.path.realpath(path)):
            raise ConnectError(
                Code.INVALID_ARGUMENT,
                f"path '{path}' is on a network mount; set allow_network_mounts to watch it",
            )
        try:
            watcher = DirWatcher(
                path, recursive=request.recursive, include_entry=request.include_entry, on_event=sink
            )
        except OSError as e:
            raise _os_error(e, path) from None
        watcher.attach(asyncio.get_running_loop())
        return watcher

    async def watch_dir(self, request: WatchDirRequest, ctx: Any) -> AsyncIterator[WatchDirResponse]:
        queue: asyncio.Queue[FilesystemEvent] = asyncio.Queue()
        watcher = self._open_watch(request, ctx, queue.put_nowait)
        keepalive_s = keepalive_interval(ctx)
        try:
            started: Oneof[Literal["start"], WatchDirResponse.StartEvent] = Oneof("start",
                                                                                  WatchDirResponse.StartEvent())
            yield WatchDirResponse(event=started)
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), keepalive_s)
                except TimeoutError:
                    yield _KEEPALIVE
                    continue
                changed: Oneof[Literal["filesystem"], FilesystemEvent] = Oneof("filesystem", event)
                yield WatchDirResponse(event=changed)
        finally:
            watcher.close()

    async def create_watcher(self, request: CreateWatcherRequest, ctx: Any) -> CreateWatcherResponse:
        polled = _PolledWatcher()
        polled.watcher = self._open_watch(request, ctx, polled.add)
        watcher_id = "w" + uuid.uuid4().hex[:16]
        self._watchers[watcher_id] = polled
        return CreateWatcherResponse(watcher_id=watcher_id)

    def _polled(self, watcher_id: str) -> _PolledWatcher:
        polled = self._watchers.get(watcher_id)
        if polled is None:
            raise ConnectError(Code.NOT_FOUND, f"watcher '{watcher_id}' not found")
        return polled

    async def get_watcher_events(self, request: GetWatcherEventsRequest, ctx: Any) -> GetWatcherEventsResponse:
        polled = self._polled(request.watcher_id)
        if polled.watcher is not None:
            polled.watcher.pump()  # events the kernel queued but the loop has not read yet belong to this poll
        events, polled.events = polled.events, []
        return GetWatcherEventsResponse(events=events)

    async def remove_watcher(self, request: RemoveWatcherRequest, ctx: Any) -> RemoveWatcherResponse:
        polled = self._watchers.pop(request.watcher_id, None)
        if polled is not None and polled.watcher is not None:
            polled.watcher.close()
        return RemoveWatcherResponse()

    def close(self) -> None:
        for polled in self._watchers.values():
            if polled.watcher is not None:
                polled.watcher.close()
        self._watchers.clear()
