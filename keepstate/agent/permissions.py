"""File permissions of the selected user, enforced by an agent that runs as root.

The agent opens files as root, so the kernel never refuses it; these checks make `/files` and the filesystem RPCs
behave as if the user did it: reading needs r on the file and x on every directory on the way, writing needs w on an
existing file or w+x on the directory an entry is created in, listing needs r+x, removing needs w+x on the parent
(and, under a sticky directory, owning the entry or the directory). Root bypasses all of it, like the kernel.

`allowed` and `sticky_allows` are pure; the `check_*` functions stat the filesystem and raise `PermissionDenied`.
"""

from __future__ import annotations

import os
import posixpath
import stat
from dataclasses import dataclass

from keepstate.agent.users import group_list

R, W, X = 4, 2, 1


class PermissionDenied(PermissionError):
    def __init__(self, who: Identity, verb: str, path: str) -> None:
        super().__init__(f"permission denied: user '{who.name}' may not {verb} '{path}'")
        self.path = path


@dataclass(frozen=True)
class Identity:
    name: str
    uid: int
    gids: frozenset[int]

    @property
    def is_root(self) -> bool:
        return self.uid == 0


def identity(name: str, uid: int, gid: int) -> Identity:
    try:
        gids = frozenset(group_list(name, gid))
    except OSError:
        gids = frozenset({gid})
    return Identity(name, uid, gids)


def allowed(mode: int, owner: int, group: int, who: Identity, want: int) -> bool:
    """The kernel's owner/group/other rule over st_mode bits (no ACLs). Only one class applies: an owner without
    the bit is refused even when "other" has it."""
    if who.is_root:
        return True
    if owner == who.uid:
        bits = (mode >> 6) & 7
    elif group in who.gids:
        bits = (mode >> 3) & 7
    else:
        bits = mode & 7
    return bits & want == want


def sticky_allows(dir_mode: int, dir_owner: int, entry_owner: int, who: Identity) -> bool:
    """Under a sticky directory (/tmp) only the entry's owner, the directory's owner or root may unlink/rename."""
    if who.is_root or not dir_mode & stat.S_ISVTX:
        return True
    return who.uid in (dir_owner, entry_owner)


def _need(st: os.stat_result, who: Identity, want: int, verb: str, path: str) -> None:
    if not allowed(st.st_mode, st.st_uid, st.st_gid, who, want):
        raise PermissionDenied(who, verb, path)


def check_traverse(directory: str, who: Identity) -> None:
    """x on every directory from / down to `directory` itself (symlinks resolved, as the kernel walks them)."""
    if who.is_root:
        return
    real = os.path.realpath(directory)
    current = "/"
    parts = [p for p in real.split("/") if p]
    for part in [None, *parts]:
        if part is not None:
            current = posixpath.join(current, part)
        try:
            st = os.stat(current)
        except FileNotFoundError:
            return  # the caller reports the missing path itself
        if not stat.S_ISDIR(st.st_mode):
            return
        _need(st, who, X, "enter", current)


def check_read(path: str, who: Identity) -> None:
    if who.is_root:
        return
    check_traverse(posixpath.dirname(path), who)
    try:
        st = os.stat(path)
    except OSError:
        return
    _need(st, who, R | X if stat.S_ISDIR(st.st_mode) else R, "read", path)


def check_list(path: str, who: Identity) -> None:
    """Listing or watching a directory: r+x on it. (Not a directory: the caller says so, not us.)"""
    if who.is_root:
        return
    check_traverse(posixpath.dirname(path), who)
    try:
        st = os.stat(path)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode):
        _need(st, who, R | X, "list", path)


def check_enter(path: str, who: Identity) -> None:
    """Using a directory as the working directory: x on it and on the way there."""
    check_traverse(path, who)


def check_stat(path: str, who: Identity) -> None:
    if not who.is_root:
        check_traverse(posixpath.dirname(path), who)


def _deepest_existing(path: str) -> str:
    current = path
    while not os.path.lexists(current):
        parent = posixpath.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def check_create(path: str, who: Identity) -> None:
    """Writing `path` (a file, or a directory with `mkdir -p`): w on it when it exists, else w+x on the deepest
    existing ancestor, the one the first new entry is created in (the rest are then the user's own)."""
    if who.is_root:
        return
    if os.path.lexists(path):
        check_traverse(posixpath.dirname(path), who)
        try:
            st = os.stat(path)
        except OSError:
            return
        if not stat.S_ISDIR(st.st_mode):
            _need(st, who, W, "write", path)
        return
    anchor = _deepest_existing(path)
    check_traverse(anchor, who)
    try:
        st = os.stat(anchor)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode):
        _need(st, who, W | X, "create entries in", anchor)


def _check_unlink(path: str, who: Identity) -> None:
    parent = posixpath.dirname(path)
    check_traverse(parent, who)
    try:
        pst, est = os.stat(parent), os.lstat(path)
    except OSError:
        return
    _need(pst, who, W | X, "remove entries from", parent)
    if not sticky_allows(pst.st_mode, pst.st_uid, est.st_uid, who):
        raise PermissionDenied(who, "remove", path)


def check_remove(path: str, who: Identity) -> None:
    """`rm -rf`: unlinking the entry, and for a directory emptying every directory below it (r+w+x)."""
    if who.is_root:
        return
    _check_unlink(path, who)
    if os.path.islink(path) or not os.path.isdir(path):
        return
    for root, dirs, files in os.walk(path, onerror=lambda e: None):
        st = os.stat(root)
        if dirs or files:
            _need(st, who, R | W | X, "remove entries from", root)
        if stat.S_ISVTX & st.st_mode:
            for name in dirs + files:
                entry = os.lstat(posixpath.join(root, name))
                if not sticky_allows(st.st_mode, st.st_uid, entry.st_uid, who):
                    raise PermissionDenied(who, "remove", posixpath.join(root, name))


def check_move(source: str, destination: str, who: Identity) -> None:
    if who.is_root:
        return
    _check_unlink(source, who)
    if os.path.lexists(destination):
        _check_unlink(destination, who)  # replacing an entry is unlinking it
    else:
        check_create(destination, who)


_AGENT_IS_ROOT = os.geteuid() == 0


def for_user(name: str, uid: int, gid: int) -> Identity:
    """The identity to check as. An agent that is not root (a developer's run) is checked by the kernel anyway."""
    if not _AGENT_IS_ROOT:
        return Identity(name, 0, frozenset())
    return identity(name, uid, gid)
