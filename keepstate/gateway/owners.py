"""Who owns a call in flight (keepstate/db/repos/ledger_claims.py says what each kind of owner means).

- The gateway of a `keepstate serve` (a node of a cluster, or the single server's node `local`) writes its node's
  current incarnation, `node/<node>/<incarnation>`, once the server tells it (`Owners.attach`): every node judges
  that owner by the shared `nodes` table, so a call whose node died is taken over by whichever node its retry
  reaches, once, and a live node's call by none.
- A standalone `keepstate gateway` process writes `pid:nonce` (the nonce tells a process from an earlier one that
  had its pid), judged by the pids of this host: such a gateway's calls are recovered by one on the same host.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from keepstate import pids
from keepstate.db.repos.ledger_claims import node_owner


def process_owner() -> str:
    return f"{os.getpid()}:{os.urandom(6).hex()}"


def owner_alive(owner: str, me: str) -> bool:
    """Whether the process owner `owner` is alive, as seen by the process owner `me` (on the same host)."""
    if owner == me:
        return True
    try:
        pid = int(owner.split(":", 1)[0])
    except ValueError:
        return True  # not a process owner: never judged by this host's pids
    if pid == os.getpid():  # same pid, other nonce: an earlier process that had our pid (e.g. pid 1 in a container)
        return False
    return pids.alive(pid)


class Owners:
    """What this gateway writes on the calls it claims, now: its node's incarnation once attached (it moves on when
    the node joins again after it was declared dead), else its process."""

    def __init__(self) -> None:
        self.process = process_owner()
        self._node: tuple[str, Callable[[], int]] | None = None
        self._current: tuple[int, str] = (0, self.process)

    def attach(self, node_id: str, incarnation: Callable[[], int]) -> None:
        """From now on, claim calls as `node_id`'s incarnation (read at each claim: a rejoin moves it on)."""
        self._node = (node_id, incarnation)

    def current(self) -> str:
        if self._node is None:
            return self.process
        incarnation = self._node[1]()
        if incarnation > 0 and incarnation != self._current[0]:  # 0: not joined (yet, or again): keep the last
            self._current = (incarnation, node_owner(self._node[0], incarnation))
        return self._current[1]

    def alive(self, owner: str) -> bool:
        """Whether a process owner is alive (the ledger judges node owners by the `nodes` table itself)."""
        return owner == self.current() or owner_alive(owner, self.process)
