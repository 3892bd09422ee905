"""Warm-pool refills (sandbox/pool.py): held back while creates keep taking from a pool at least half full."""

from __future__ import annotations

import asyncio
from typing import cast

from keepstate.sandbox.pool import QUIET_S, WarmPool
from keepstate.sandbox.record import SandboxRow


def _rows(n: int) -> list[SandboxRow]:
    return [cast(SandboxRow, object()) for _ in range(n)]


def test_a_refill_waits_while_creates_take_from_a_pool_at_least_half_full() -> None:
    async def go() -> None:
        pool = WarmPool("k", 4, start=lambda: asyncio.sleep(0, _rows(1)[0]))
        for row in _rows(4):
            pool.adopt(row)
        assert pool.hold(asyncio.get_running_loop().time()) == 0  # nothing taken yet
        pool.take()
        now = asyncio.get_running_loop().time()
        assert 0 < pool.hold(now) <= QUIET_S  # 3 of 4 left: the refill waits
        assert pool.hold(now + QUIET_S) == 0  # ... until creates have stopped taking for QUIET_S
        pool.take()
        assert pool.hold(now) > 0  # 2 of 4: still half full
        pool.take()
        assert pool.hold(now) == 0  # 1 of 4: below half, refill at once

    asyncio.run(go())


def test_the_pool_refills_once_takes_stop() -> None:
    async def go() -> None:
        started: list[SandboxRow] = []
        full = asyncio.Event()

        async def start() -> SandboxRow:
            row = _rows(1)[0]
            started.append(row)
            if len(started) == 3:
                full.set()
            return row

        pool = WarmPool("k", 2, start=start)
        pool.start()
        await asyncio.wait_for(_until(lambda: len(pool) == 2), 5)
        assert pool.take() is started[0]
        await asyncio.wait_for(full.wait(), 5)  # one take, then quiet: refilled
        await asyncio.wait_for(_until(lambda: len(pool) == 2), 5)
        await pool.stop()

    asyncio.run(go())


async def _until(ok: object) -> None:
    assert callable(ok)
    while not ok():
        await asyncio.sleep(0)
