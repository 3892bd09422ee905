"""Process lifecycle guarantees: streamed input, late Connect, no zombies, template services kept alive."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.agent.harness import AgentProcess, eventually


def _children(pid: int) -> dict[int, str]:
    """pid -> state letter of every process whose parent is `pid`."""
    out: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            out[int(entry)] = fields[0]
    return out


def test_stream_input(sandbox) -> None:
    if not hasattr(sandbox.commands, "stream_input"):
        pytest.skip("this SDK has no stream_input")
    handle = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.stream_input(handle.pid, (f"chunk {i}\n" for i in range(50)))
    sandbox.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "".join(f"chunk {i}\n" for i in range(50))


def test_connect_after_exit_gets_end(sandbox) -> None:
    handle = sandbox.commands.run("echo early; exit 4", background=True)
    from e2b import CommandExitException

    with pytest.raises(CommandExitException):
        handle.wait()
    late = sandbox.commands.connect(handle.pid)
    with pytest.raises(CommandExitException) as info:
        late.wait()
    assert info.value.exit_code == 4
    assert info.value.stdout == ""  # live output only: nothing is replayed


def test_no_zombies_left(sandbox) -> None:
    # bash's parent is the agent, in a gVisor sandbox as on the host; ask from inside, so both modes agree.
    agent_pid = int(sandbox.commands.run("echo $PPID", user="root").stdout)
    for i in range(10):
        sandbox.commands.run(f"true {i}")
        sandbox.commands.run("sleep 5", background=True).kill()
    sandbox.pty.kill(sandbox.pty.create(__import__("e2b").sandbox.commands.command_handle.PtySize(24, 80)).pid)

    def states() -> list[str]:
        out = sandbox.commands.run(f"ps -o stat= --ppid {agent_pid} || true", user="root").stdout
        return [line.strip() for line in out.splitlines()]

    # The `ps` itself and its bash are children too, alive while they answer; no one else may be a zombie.
    assert eventually(lambda: not any(s.startswith("Z") for s in states())), states()


def test_template_service_restarted(host_user, tmp_path) -> None:  # type: ignore[no-untyped-def]
    pid_file = tmp_path / "svc.pid"
    template = {
        "user": "user", "workdir": "/home/user",
        "services": [{"name": "svc", "command": ["/bin/sh", "-c", f"echo $$ >> {pid_file}; exec sleep 300"],
                      "user": "root"}],
    }
    agent = AgentProcess(tmp_path, template).start()
    try:
        assert eventually(lambda: pid_file.exists() and pid_file.read_text().strip() != "")
        first = int(pid_file.read_text().split()[0])
        assert first in _children(agent.proc.pid)
        os.kill(first, signal.SIGKILL)
        assert eventually(lambda: len(pid_file.read_text().split()) >= 2)
        second = int(pid_file.read_text().split()[1])
        assert second != first
        # The dead one was reaped, the new one is ours.
        assert eventually(lambda: first not in _children(agent.proc.pid))
        assert second in _children(agent.proc.pid)
    finally:
        agent.stop()
    assert json.loads(agent.template_path.read_text())["services"][0]["name"] == "svc"

    def gone(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
        except OSError:
            return True

    assert eventually(lambda: gone(second))  # a stopped agent takes its services with it


def test_template_service_output_goes_to_its_log_file(host_user, tmp_path) -> None:  # type: ignore[no-untyped-def]
    pid_file = tmp_path / "svc.pid"
    template = {
        "user": "user", "workdir": "/home/user",
        "services": [{"name": "svc", "user": "root", "command": [
            "/bin/sh", "-c", f"echo $$ >> {pid_file}; echo out-$$; echo err-$$ >&2; exec sleep 300"]}],
    }
    agent = AgentProcess(tmp_path, template)
    log_file = agent.service_log_dir / "svc.log"
    agent.service_log_dir.mkdir()
    log_file.write_bytes(b"an old run\n" * (1 << 20))  # over 8 MiB: set aside at the next start
    agent.start()
    try:
        assert eventually(lambda: pid_file.exists() and len(pid_file.read_text().split()) == 1)
        first = int(pid_file.read_text().split()[0])
        assert eventually(lambda: f"err-{first}" in log_file.read_text())
        os.kill(first, signal.SIGKILL)
        assert eventually(lambda: len(pid_file.read_text().split()) == 2)
        second = int(pid_file.read_text().split()[1])
        # Restarts append: both runs' stdout and stderr, in order; the old log was rotated, not appended to.
        assert eventually(lambda: log_file.read_text().splitlines() == [
            f"out-{first}", f"err-{first}", f"out-{second}", f"err-{second}"]), log_file.read_text()[:200]
        assert (agent.service_log_dir / "svc.log.1").read_bytes().startswith(b"an old run\n")
    finally:
        agent.stop()
