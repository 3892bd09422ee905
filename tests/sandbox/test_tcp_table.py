"""tcp_table.settled: what a checkpoint's quiesce and an idle freeze wait for before they go ahead."""

from __future__ import annotations

import time

from keepstate.sandbox.tcp_table import settled


async def test_settled_returns_once_the_sandbox_has_answered_the_closes() -> None:
    answers = iter([["04"], ["05"], []])  # FIN_WAIT1, FIN_WAIT2, then nothing but closed connections
    asked: list[str] = []

    def probe(address: str) -> list[str]:
        asked.append(address)
        return next(answers)

    assert await settled("10.88.0.2", within=5, every=0.01, probe=probe) == []
    assert asked == ["10.88.0.2"] * 3


async def test_settled_gives_up_after_its_bound_and_says_what_is_open() -> None:
    started = time.monotonic()
    assert await settled("10.88.0.2", within=0.2, every=0.02, probe=lambda a: ["08"]) == ["08"]
    assert time.monotonic() - started >= 0.2
