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


def lookup_user(name: str) -> User:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise UnknownUser(name) from None
    return User(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir or "/", entry.pw_shell or "/bin/sh")


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
