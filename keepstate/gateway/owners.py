"""Who owns a call in flight: a process, named `pid:nonce` (the nonce tells a process from an earlier one that had
its pid). A call whose owner is gone is recovered as interrupted (Ledger.recover)."""

from __future__ import annotations

import os

from keepstate import pids


def process_owner() -> str:
    return f"{os.getpid()}:{os.urandom(6).hex()}"


def owner_alive(owner: str, me: str) -> bool:
    if owner == me:
        return True
    pid = int(owner.split(":", 1)[0])
    if pid == os.getpid():  # same pid, other nonce: an earlier process that had our pid (e.g. pid 1 in a container)
        return False
    return pids.alive(pid)
