"""Locks: shared for writers and readers, exclusive for gc (rules W1 and D2 of checkpoint-format.md).

Like restic's, these locks are advisory objects in the repository, so they work on any backend: take a lock by
writing it, then list the others; on conflict, withdraw. Two racing parties may both withdraw, never both proceed.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import dataclass

from keepstate import pids
from keepstate.store.backend import Backend
from keepstate.store.errors import ObjectNotFound, RepositoryLocked

PREFIX = "locks/"
STALE_AFTER = 30 * 60.0
REFRESH_AFTER = 5 * 60.0


@dataclass(frozen=True)
class LockInfo:
    key: str
    kind: str
    host: str
    pid: int
    created: float
    purpose: str

    def is_stale(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        if now - self.created > STALE_AFTER:
            return True
        return self.host == socket.gethostname() and not pids.alive(self.pid)

    def describe(self) -> str:
        age = int(time.time() - self.created)
        return f"{self.kind} lock by pid {self.pid} on {self.host} ({self.purpose}, {age} s old)"




def read_locks(backend: Backend) -> list[LockInfo]:
    locks = []
    for info in backend.list(PREFIX):
        try:
            data = json.loads(backend.load(info.key))
            locks.append(LockInfo(info.key, str(data["kind"]), str(data["host"]), int(data["pid"]),
                                  float(data["created"]), str(data.get("purpose", ""))))
        except ObjectNotFound:
            continue  # released while we listed
        except (ValueError, KeyError, TypeError):
            # An unreadable lock could be a half-visible write on a weak store; treat it as held until stale.
            locks.append(LockInfo(info.key, "exclusive", "?", -1, time.time(), "unreadable lock object"))
    return locks


def remove_stale(backend: Backend) -> int:
    removed = 0
    for lock in read_locks(backend):
        if lock.is_stale():
            backend.remove(lock.key)
            removed += 1
    return removed


class Lock:
    """A held lock; use as a context manager. `refresh()` keeps a long-held lock from turning stale."""

    def __init__(self, backend: Backend, kind: str, purpose: str) -> None:
        if kind not in ("shared", "exclusive"):
            raise ValueError(f"lock kind {kind!r}")
        self.backend = backend
        self.kind = kind
        self.purpose = purpose
        self.key = ""
        self.created = 0.0

    def _write(self) -> str:
        key = f"{PREFIX}{secrets.token_hex(16)}"
        self.created = time.time()
        body = {"kind": self.kind, "host": socket.gethostname(), "pid": os.getpid(),
                "created": self.created, "purpose": self.purpose}
        self.backend.save(key, json.dumps(body).encode())
        return key

    def acquire(self) -> Lock:
        self.key = self._write()
        conflicts = [lock for lock in read_locks(self.backend)
                     if lock.key != self.key and not lock.is_stale()
                     and (self.kind == "exclusive" or lock.kind == "exclusive")]
        if conflicts:
            self.backend.remove(self.key)
            self.key = ""
            raise RepositoryLocked(
                f"{self.backend.location} is locked ({'; '.join(c.describe() for c in conflicts)}); "
                "try again later, or remove a lock that is known dead from its locks/ directory")
        return self

    def refresh(self) -> None:
        if self.key and time.time() - self.created > REFRESH_AFTER:
            old, self.key = self.key, self._write()
            self.backend.remove(old)

    def release(self) -> None:
        if self.key:
            self.backend.remove(self.key)
            self.key = ""

    def __enter__(self) -> Lock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
