"""Sandbox users: lookup, path resolution relative to their home, ownership of what we create for them."""

from __future__ import annotations

import os
import posixpath
import pwd
from dataclasses import dataclass

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class UnknownUser(LookupError):
    def __init__(self, name: str) -> None:
        super().__init__(f"invalid username: '{name}'")
        self.name = name


class BadPath(ValueError):
    """A path the agent refuses to touch (e.g. it contains a NUL byte)."""


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str
    shell: str


# Looking a user or a user's groups up reads /etc/passwd or /etc/group (and nsswitch.conf) each time: ~1 ms under
# gVisor, on every command's path (getgrouplist for the permission check, the identity switch and the spare's
# check). Answers are kept while those files are unchanged (inode, size, mtime, ctime: useradd, usermod and
# groupadd write a new file and rename it into place).
_DATABASES = {"passwd": ("/etc/passwd", "/etc/nsswitch.conf"), "group": ("/etc/group", "/etc/nsswitch.conf")}
_cache: dict[str, tuple[object, dict[object, object]]] = {}


def files_state(paths: tuple[str, ...]) -> tuple[tuple[int, int, int, int] | None, ...]:
    """Each file's (inode, size, mtime, ctime), None if absent: what changes when a file is written or replaced."""
    out: list[tuple[int, int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append(None)
        else:
            out.append((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


def _cached(database: str) -> dict[object, object]:
    state = files_state(_DATABASES[database])
    held = _cache.get(database)
    if held is None or held[0] != state:
        held = _cache[database] = (state, {})
    return held[1]


def lookup_user(name: str) -> User:
    answers = _cached("passwd")
    user = answers.get(name)
    if not isinstance(user, User):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise UnknownUser(name) from None
        user = answers[name] = User(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir or "/",
                                    entry.pw_shell or "/bin/sh")
    return user


def group_list(name: str, gid: int) -> list[int]:
    """os.getgrouplist(name, gid), kept while /etc/group is unchanged. Raises OSError as it does."""
    answers = _cached("group")
    groups = answers.get((name, gid))
    if not isinstance(groups, tuple):
        groups = answers[(name, gid)] = tuple(os.getgrouplist(name, gid))
    return list(groups)


Ids = tuple[int, int, tuple[int, ...]]  # uid, gid, supplementary groups (permissions.Identity has the name too)


def identity_of(user: User) -> Ids:
    return user.uid, user.gid, tuple(group_list(user.name, user.gid))


def setpriv_flags(user: User) -> list[str]:
    """setpriv's arguments (up to its `--`) to become `user`: real, effective and saved ids, and its groups."""
    uid, gid, groups = identity_of(user)
    return [f"--reuid={uid}", f"--regid={gid}", f"--groups={','.join(map(str, groups))}", "--"]


def resolve_path(path: str, user: User, default_workdir: str = "") -> str:
    """envd's rule: "" → default workdir (else home); "~"/"~/x" → home; relative → home/x; result cleaned."""
    if "\x00" in path:
        raise BadPath("path contains a NUL byte")
    if path == "":
        path = default_workdir or user.home
    if path == "~":
        path = user.home
    elif path.startswith("~/"):
        path = posixpath.join(user.home, path[2:])
    elif not path.startswith("/"):
        path = posixpath.join(user.home, path)
    return posixpath.normpath(path) if path != "/" else "/"


def process_env(user: User, sandbox_env: dict[str, str], request_env: dict[str, str]) -> dict[str, str]:
    env = {"PATH": DEFAULT_PATH, "HOME": user.home, "USER": user.name, "LOGNAME": user.name}
    env.update(sandbox_env)
    env.update(request_env)
    return env


def make_dirs_for(path: str, user: User, mode: int = 0o755) -> None:
    """`mkdir -p` that chowns only the directories it created, so a user owns the tree it asked for."""
    missing: list[str] = []
    current = path
    while not os.path.lexists(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            continue
        os.chown(d, user.uid, user.gid)
