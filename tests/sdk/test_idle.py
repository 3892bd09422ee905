"""Idle sandboxes are frozen (docs/design/idle.md), with the stock SDK on real gVisor sandboxes: an idle sandbox's
cgroup is frozen and uses no CPU at all, and whatever the SDK sends it next works as if it had never been frozen.

The server under test freezes after its default `--freeze-idle-after`. What the host sees (the sandbox's freezer
state and CPU time) is read from its cgroups, found by the runtime name the server's database records for it.
"""

from __future__ import annotations

import errno
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from sdkharness import Server, wait_until

CGROUP = Path("/sys/fs/cgroup")
FREEZE_WAIT = 60.0  # seconds to wait for a freeze (the default is about 3 s after the last call)


def runtime_name(server: Server, sandbox_id: str) -> str:
    if not server.home:
        pytest.fail("the server's data directory is unknown (KEEPSTATE_TEST_HOME): its cgroups cannot be found")
    db = sqlite3.connect(f"file:{server.home}/keepstate.sqlite?mode=ro", uri=True, timeout=10)
    try:
        row = db.execute("SELECT runtime_name FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,)).fetchone()
    finally:
        db.close()
    assert row and row[0], f"no instance recorded for {sandbox_id}"
    return str(row[0])


def freezer_state(name: str) -> str:
    """FROZEN, THAWED or GONE. A cgroup being removed while it is read answers ENODEV (or ENOENT): gone."""
    v1 = CGROUP / "freezer" / "keepstate" / name / "freezer.state"
    try:
        if v1.parent.parent.parent.exists():
            return v1.read_text().strip()
        v2 = CGROUP / "keepstate" / name / "cgroup.freeze"
        return "FROZEN" if v2.read_text().strip() == "1" else "THAWED"
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENODEV):
            return "GONE"
        raise


def cpu_ns(name: str) -> int:
    v1 = CGROUP / "cpuacct" / "keepstate" / name / "cpuacct.usage"
    if v1.exists():
        return int(v1.read_text())
    stat = dict(line.split() for line in (CGROUP / "keepstate" / name / "cpu.stat").read_text().splitlines())
    return int(stat["usage_usec"]) * 1000


class Watched:
    def __init__(self, server: Server, sbx: Any) -> None:
        self.sbx = sbx
        self.name = runtime_name(server, sbx.sandbox_id)

    def frozen(self) -> None:
        wait_until(lambda: freezer_state(self.name) == "FROZEN", FREEZE_WAIT,
                   lambda: f"sandbox {self.sbx.sandbox_id} to be frozen (freezer: {freezer_state(self.name)})")


def test_an_idle_sandbox_is_frozen_uses_no_cpu_and_answers_everything(server: Server, new_sandbox: Any) -> None:
    w = Watched(server, new_sandbox())
    sbx = w.sbx
    sbx.files.write("/home/user/note.txt", "kept\n")
    w.frozen()
    before = cpu_ns(w.name)
    time.sleep(3)  # nothing of the server's (metrics, journal, its own looks) may wake it meanwhile
    assert freezer_state(w.name) == "FROZEN" and cpu_ns(w.name) == before
    result = sbx.commands.run("cat /home/user/note.txt && echo ok")
    assert result.exit_code == 0 and result.stdout == "kept\nok\n"
    w.frozen()
    assert sbx.files.read("/home/user/note.txt") == "kept\n"
    w.frozen()
    assert "note.txt" in [e.name for e in sbx.files.list("/home/user")]
    w.frozen()
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: sbx.commands.run(f"echo {i}").stdout, range(8)))
    assert outs == [f"{i}\n" for i in range(8)]


def states_for(name: str, seconds: float) -> set[str]:
    """The freezer states seen over the next `seconds` (while a command of known length runs)."""
    seen, until = set(), time.monotonic() + seconds
    while time.monotonic() < until:
        seen.add(freezer_state(name))
        time.sleep(0.1)
    return seen


def test_a_running_command_keeps_its_sandbox_awake(server: Server, new_sandbox: Any) -> None:
    w = Watched(server, new_sandbox())
    sbx = w.sbx
    w.frozen()
    # Its output streaming to the SDK: the server sees a request in flight.
    handle = sbx.commands.run("sleep 6 && echo done", background=True)
    seen = states_for(w.name, 6)
    assert handle.wait().stdout == "done\n"
    assert "FROZEN" not in seen, seen
    w.frozen()
    # Nobody connected to it: the agent says it is not idle while the command runs.
    handle = sbx.commands.run("sleep 6 && echo done > /tmp/done", background=True)
    handle.disconnect()
    seen = states_for(w.name, 6)
    wait_until(lambda: sbx.files.exists("/tmp/done"), 60, "the background command to finish")
    assert sbx.files.read("/tmp/done") == "done\n"
    assert "FROZEN" not in seen, seen


def test_pause_resume_and_kill_of_a_frozen_sandbox(server: Server, new_sandbox: Any) -> None:
    from e2b import Sandbox

    w = Watched(server, new_sandbox())
    sbx = w.sbx
    sbx.files.write("/home/user/state.txt", "before the pause\n")
    w.frozen()
    assert sbx.pause()
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=120)
    assert resumed.commands.run("cat /home/user/state.txt").stdout == "before the pause\n"
    again = Watched(server, resumed)  # a resume from the standby runs the same instance, from the store a new one
    again.frozen()
    resumed.kill()
    wait_until(lambda: freezer_state(again.name) == "GONE", 60, f"the cgroup of {again.name} to go")
