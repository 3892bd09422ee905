"""The fake provider on a loop of its own, for synchronous tests (the E2B SDK's, a CLI's) that need one."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from keepstate.testing.fake_provider import FakeProvider


@contextmanager
def fake_provider_in_thread(fake: FakeProvider | None = None, start_timeout_s: float = 30.0) -> Iterator[FakeProvider]:
    """Serve `fake` (a new FakeProvider by default) from a daemon thread until the block ends.

    Its latency settings, faults and stats may be read and changed from the calling thread: the fake reads them
    afresh for every request."""
    fake = fake or FakeProvider()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    failure: list[BaseException] = []

    def serve() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(fake.start())
        except BaseException as e:  # reported to the caller below
            failure.append(e)
            ready.set()
            return
        ready.set()
        loop.run_forever()
        loop.run_until_complete(fake.stop())

    thread = threading.Thread(target=serve, name="fake-provider", daemon=True)
    thread.start()
    if not ready.wait(start_timeout_s):
        raise TimeoutError("the fake provider did not start")
    if failure:
        thread.join()
        loop.close()
        raise RuntimeError("the fake provider did not start") from failure[0]
    try:
        yield fake
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=start_timeout_s)
        loop.close()
