"""Guest-health-aware pauses with the stock SDK (e2b 2.63, issue 28), on gVisor: the sandbox's agent is stopped
(SIGSTOP, from inside); `pause(strict=True)` raises ServiceBusyException and the sandbox runs on; a plain pause is
taken and marked (`envd_unresponsive_at_pause`), and a connect raises GuestUnresponsiveException."""

from __future__ import annotations

import inspect

import pytest
from e2b import Sandbox, SandboxState

from sdkharness import wait_until

# The agent is tini's child (keepstate/runtime/agent_runtime.py; tini, PID 1, names boot.py too): found by its
# command line, stopped after the command that starts this has been answered.
STOP_AGENT = ("sleep 1; for p in $(ls /proc | grep -E '^[0-9]+$' | sort -n | grep -vx 1); do "
              "if tr '\\0' ' ' < /proc/$p/cmdline 2>/dev/null | grep -q agent/boot.py; then kill -STOP $p; break; fi; "
              "done")

pytestmark = pytest.mark.skipif("strict" not in inspect.signature(Sandbox.pause).parameters,
                                reason="this SDK release has no guest-health pause (e2b < 2.63)")


def test_a_pause_of_a_sandbox_whose_agent_does_not_answer(new_sandbox) -> None:
    from e2b.exceptions import GuestUnresponsiveException, ServiceBusyException

    sbx = new_sandbox(timeout=300)
    sbx.files.write("/home/user/kept.txt", "before the agent stopped")
    sbx.commands.run(STOP_AGENT, user="root", background=True)
    wait_until(lambda: not _answers(sbx), 30, "the sandbox's agent to stop answering")

    with pytest.raises(ServiceBusyException):
        sbx.pause(strict=True)
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.RUNNING  # it runs on

    assert sbx.pause() is True  # taken anyway, and marked
    info = Sandbox.get_info(sbx.sandbox_id)
    assert info.state == SandboxState.PAUSED
    with pytest.raises(GuestUnresponsiveException):
        Sandbox.connect(sbx.sandbox_id)


def _answers(sbx: Sandbox) -> bool:
    try:
        return bool(sbx.commands.run("true", timeout=3, request_timeout=3).exit_code == 0)
    except Exception:
        return False
