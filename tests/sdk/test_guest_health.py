"""Guest-health-aware pauses with the stock SDK (e2b 2.63, issue 28), on gVisor: the sandbox's agent is stopped
(SIGSTOP, from inside); `pause(strict=True)` raises ServiceBusyException and the sandbox runs on; a plain pause is
taken and marked (`envd_unresponsive_at_pause`), a connect raises GuestUnresponsiveException, and a connect with
`on_resume="reboot"` boots it anew (a new boot id) from the files it had (docs/design/sandbox-disk.md)."""

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
    boot_id = sbx.files.read("/proc/sys/kernel/random/boot_id").strip()
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

    rebooted = Sandbox.connect(sbx.sandbox_id, on_resume="reboot")
    assert rebooted.sandbox_id == sbx.sandbox_id and Sandbox.get_info(sbx.sandbox_id).state == SandboxState.RUNNING
    assert rebooted.files.read("/home/user/kept.txt") == "before the agent stopped"
    assert rebooted.files.read("/proc/sys/kernel/random/boot_id").strip() != boot_id
    assert rebooted.commands.run("echo answering").stdout == "answering\n"  # a new agent, not the stopped one
    rebooted.pause()  # an ordinary sandbox again: paused with memory, connected without a word
    assert Sandbox.connect(sbx.sandbox_id).files.read("/home/user/kept.txt") == "before the agent stopped"


def test_a_healthy_sandbox_paused_with_memory_reboots_from_its_files(new_sandbox) -> None:
    sbx = new_sandbox(timeout=300)
    sbx.files.write("/home/user/kept.txt", "kept")
    sbx.commands.run("rm /home/user/.bashrc")  # a deletion is kept too
    sbx.commands.run("sleep 600", background=True)
    boot_id = sbx.files.read("/proc/sys/kernel/random/boot_id").strip()
    sbx.pause()
    rebooted = Sandbox.connect(sbx.sandbox_id, on_resume="reboot")
    assert rebooted.files.read("/home/user/kept.txt") == "kept"
    assert not rebooted.files.exists("/home/user/.bashrc")
    assert rebooted.files.read("/proc/sys/kernel/random/boot_id").strip() != boot_id
    names = rebooted.commands.run("cat /proc/[0-9]*/comm").stdout.split()
    assert "tini" in names and "sleep" not in names  # its processes are not


def _answers(sbx: Sandbox) -> bool:
    try:
        return bool(sbx.commands.run("true", timeout=3, request_timeout=3).exit_code == 0)
    except Exception:
        return False
