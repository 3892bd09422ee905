"""Racing two writers for real: a Database whose write transactions, their statements done, hold their locks until
the test lets them commit, so a second writer started meanwhile meets those locks (PostgreSQL's row and index locks,
SQLite's write lock) instead of running before or after the first by luck of scheduling."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from keepstate.db.engine import Conn, Database

SETTLE_S = 0.3  # how long the second writer is given to reach the first's lock (it must still be waiting after it)


class HeldCommit(Database):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.holding = asyncio.Event()  # a write transaction ran its statements and waits to commit
        self.release = asyncio.Event()  # let it commit

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Conn]:
        async with super().transaction() as conn:
            yield conn
            self.holding.set()
            await self.release.wait()


async def race(held: HeldCommit, first: Callable[[], Awaitable[Any]],
               second: Callable[[], Awaitable[Any]]) -> list[Any]:
    """Run `first` on `held` until it holds its locks, start `second` (on another Database), check that it waits,
    then let `first` commit; both outcomes, a raised exception as the value."""
    one = asyncio.ensure_future(first())
    await asyncio.wait_for(held.holding.wait(), timeout=30)
    two = asyncio.ensure_future(second())
    await asyncio.sleep(SETTLE_S)
    waited = not two.done()
    held.release.set()
    outcomes = list(await asyncio.gather(one, two, return_exceptions=True))
    assert waited, f"the second writer did not wait for the first: {outcomes}"
    return outcomes
