"""Directory watches on inotify: events named relative to the watched dir, new subdirectories followed."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from inotify_simple import INotify
from inotify_simple import flags as F

from keepstate.agent.entry import entry_info
from keepstate.agent.proto.filesystem.filesystem_pb import EventType, FilesystemEvent

_MASK = (
    F.CREATE | F.MODIFY | F.DELETE | F.DELETE_SELF | F.MOVED_FROM | F.MOVED_TO | F.ATTRIB | F.MOVE_SELF
    | F.DONT_FOLLOW | F.EXCL_UNLINK
)
_ENTRY_TYPES = {EventType.CREATE, EventType.WRITE, EventType.CHMOD}

# Network file systems where inotify sees only local changes; watching them needs an explicit opt-in.
NETWORK_FS_TYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "ceph", "glusterfs", "fuse.sshfs", "fuse.rclone",
    "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "lustre",
})


def event_type(mask: int) -> EventType | None:
    """fsnotify's mapping: MOVED_TO is a create, MOVED_FROM a rename, ATTRIB a chmod."""
    if mask & (F.CREATE | F.MOVED_TO):
        return EventType.CREATE
    if mask & F.MODIFY:
        return EventType.WRITE
    if mask & (F.DELETE | F.DELETE_SELF):
        return EventType.REMOVE
    if mask & F.MOVED_FROM:
        return EventType.RENAME
    if mask & F.ATTRIB:
        return EventType.CHMOD
    return None


def fs_type_of(path: str, mounts_text: str) -> str:
    """The fs type of the longest mount point containing `path`, from /proc/self/mounts text."""
    best, best_type = "", ""
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, best_type = mount, parts[2]
    return best_type


def is_network_mount(path: str) -> bool:
    try:
        with open("/proc/self/mounts") as f:
            text = f.read()
    except OSError:
        return False
    return fs_type_of(path, text) in NETWORK_FS_TYPES


class DirWatcher:
    """One inotify instance watching `root` (and, if recursive, every directory below it)."""

    def __init__(
        self, root: str, *, recursive: bool, include_entry: bool, on_event: Callable[[FilesystemEvent], None]
    ) -> None:
        self.root = root
        self._recursive = recursive
        self._include_entry = include_entry
        self._on_event = on_event
        self._inotify = INotify(nonblocking=True)
        self._dirs: dict[int, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._add_tree(root)

    def _add_tree(self, top: str) -> None:
        self._add_dir(top)
        if not self._recursive:
            return
        for dirpath, dirnames, _files in os.walk(top):
            for name in dirnames:
                self._add_dir(os.path.join(dirpath, name))

    def _add_dir(self, path: str) -> None:
        try:
            wd = self._inotify.add_watch(path, _MASK)
        except OSError:
            return  # vanished or unreadable; nothing to report
        self._dirs[wd] = path

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self._inotify.fileno(), self.pump)

    def pump(self) -> None:
        """Read what the kernel has queued and deliver it; safe to call any time (non-blocking)."""
        try:
            events = self._inotify.read(timeout=0)
        except (BlockingIOError, OSError):
            return
        for ev in events:
            if ev.mask & F.IGNORED:
                self._dirs.pop(ev.wd, None)
                continue
            directory = self._dirs.get(ev.wd)
            if directory is None:
                continue
            path = os.path.join(directory, ev.name) if ev.name else directory
            kind = event_type(ev.mask)
            if kind is None:
                continue
            if self._recursive and ev.mask & F.ISDIR and kind == EventType.CREATE:
                self._add_tree(path)
            name = os.path.relpath(path, self.root)
            if name == ".":
                name = ""
            out = FilesystemEvent(name=name, type=kind)
            if self._include_entry and kind in _ENTRY_TYPES:
                try:
                    out.entry = entry_info(path)
                except OSError:
                    pass
            self._on_event(out)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._inotify.fileno())
            self._loop = None
        self._inotify.close()
