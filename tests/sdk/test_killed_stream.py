"""A command streaming while its sandbox is killed ends the way E2B's does (issue 28): the stream is cut, the SDK's
health probe finds the sandbox gone (the router's 502 "The sandbox was not found"), and the stock SDK raises
SandboxNotRunningException, "killed or reached its end of life while the request was in flight", not a bare
timeout."""

from __future__ import annotations

import threading

import e2b.exceptions
import pytest
from e2b import Sandbox

from sdkharness import wait_until

pytestmark = pytest.mark.skipif(not hasattr(e2b.exceptions, "SandboxNotRunningException"),
                                reason="this SDK release has no SandboxNotRunningException (e2b < 2.63)")


def test_a_command_streaming_while_its_sandbox_is_killed(new_sandbox) -> None:
    sbx = new_sandbox(timeout=300)
    failures: list[BaseException] = []

    def run() -> None:
        try:
            sbx.commands.run("sleep 60")  # a Connect stream open for the whole command
        except BaseException as exc:  # noqa: BLE001 - what the SDK raises is the point
            failures.append(exc)

    waiter = threading.Thread(target=run)
    waiter.start()
    wait_until(lambda: any("sleep 60" in " ".join([p.cmd, *p.args]) for p in sbx.commands.list()), 30,
               "the command to run")
    Sandbox.kill(sbx.sandbox_id)
    waiter.join(60)
    assert not waiter.is_alive() and len(failures) == 1
    assert isinstance(failures[0], e2b.exceptions.SandboxNotRunningException), repr(failures[0])
    assert "killed or reached its end of life" in str(failures[0])
