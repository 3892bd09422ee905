"""Commands through the stock SDK: run, background, stdin, kill, list, connect, env, cwd, users, timeouts."""

from __future__ import annotations

import re
import time

import pytest
from e2b import CommandExitException, TimeoutException

from tests.agent.harness import eventually


def test_run_echo(sandbox) -> None:
    result = sandbox.commands.run("echo hello")
    assert result.exit_code == 0
    assert result.stdout == "hello\n"
    assert result.stderr == ""


def test_stderr_and_exit_code(sandbox) -> None:
    with pytest.raises(CommandExitException) as info:
        sandbox.commands.run("echo oops >&2; exit 3")
    assert info.value.exit_code == 3
    assert info.value.stderr == "oops\n"
    assert "exit status 3" in (info.value.error or "")


def test_default_user_and_cwd(sandbox) -> None:
    result = sandbox.commands.run("whoami; pwd; echo $HOME; umask")
    assert result.stdout.split() == ["user", "/home/user", "/home/user", "0022"]


def test_user_has_no_root_left(sandbox) -> None:
    # real, effective, saved and filesystem ids are all the user's, and no capability survives the switch.
    status = sandbox.commands.run("grep -E '^(Uid|Gid|CapPrm|CapEff):' /proc/self/status").stdout
    fields = {line.split(":")[0]: line.split()[1:] for line in status.splitlines()}
    uid = sandbox.commands.run("id -u").stdout.strip()
    assert fields["Uid"] == [uid] * 4 and uid != "0"
    assert int(fields["CapPrm"][0], 16) == 0 and int(fields["CapEff"][0], 16) == 0
    with pytest.raises(CommandExitException):
        sandbox.commands.run("python3 -c 'import os; os.setuid(0)'")


def test_root_user(sandbox) -> None:
    assert sandbox.commands.run("whoami", user="root").stdout == "root\n"


def test_cwd_and_missing_cwd(sandbox, home_dir) -> None:
    sandbox.files.make_dir(home_dir)
    assert sandbox.commands.run("pwd", cwd=home_dir).stdout.strip() == home_dir
    from e2b import InvalidArgumentException

    with pytest.raises(InvalidArgumentException, match="does not exist"):
        sandbox.commands.run("pwd", cwd="/definitely/not/here")


def test_env_vars_sandbox_and_request(control_plane) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create(envs={"FROM_SANDBOX": "s1", "BOTH": "sandbox"})
    try:
        out = sbx.commands.run('echo "$FROM_SANDBOX $FROM_CMD $BOTH"', envs={"FROM_CMD": "c1", "BOTH": "cmd"})
        assert out.stdout == "s1 c1 cmd\n"
    finally:
        sbx.kill()


def test_background_and_wait(sandbox) -> None:
    handle = sandbox.commands.run("sleep 0.2; echo done", background=True)  # outlives run(): wait() waits for it
    assert handle.pid > 0
    result = handle.wait()
    assert result.stdout == "done\n"


def test_stdin_send_and_close(sandbox) -> None:
    handle = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(handle.pid, "line one\n")
    sandbox.commands.send_stdin(handle.pid, b"line two\n")
    sandbox.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "line one\nline two\n"


def test_stdin_false_reads_eof(sandbox) -> None:
    assert sandbox.commands.run("cat; echo eof", stdin=False).stdout == "eof\n"


def test_kill_and_list(sandbox) -> None:
    handle = sandbox.commands.run("sleep 30", background=True)
    listed = {p.pid: p for p in sandbox.commands.list()}
    assert handle.pid in listed
    assert listed[handle.pid].args == ["-l", "-c", "sleep 30"]
    assert listed[handle.pid].cmd == "/bin/bash"
    assert sandbox.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException) as info:
        handle.wait()
    assert info.value.exit_code == -1
    assert "killed" in (info.value.error or "")
    assert handle.pid not in {p.pid for p in sandbox.commands.list()}
    assert sandbox.commands.kill(999_999) is False


def test_connect_to_running(sandbox) -> None:
    handle = sandbox.commands.run("read x; echo got $x", background=True, stdin=True)
    other = sandbox.commands.connect(handle.pid)
    sandbox.commands.send_stdin(handle.pid, "ping\n")
    assert other.wait().stdout == "got ping\n"
    assert handle.wait().stdout == "got ping\n"


def test_disconnect_does_not_kill(sandbox) -> None:
    handle = sandbox.commands.run("read x; echo after $x", background=True, stdin=True)
    handle.disconnect()
    assert handle.pid in {p.pid for p in sandbox.commands.list()}
    again = sandbox.commands.connect(handle.pid)
    sandbox.commands.send_stdin(handle.pid, "reconnect\n")
    assert again.wait().stdout == "after reconnect\n"


def test_timeout_kills_process(sandbox) -> None:
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 20", timeout=1)
    # The agent enforces the same deadline: the process goes away long before its 20 s.
    assert eventually(lambda: not [p for p in sandbox.commands.list() if p.args[-1:] == ["sleep 20"]])


def test_background_grandchild_does_not_hold_the_command(sandbox) -> None:
    # The backgrounded sleep inherits stdout; the command must still end when bash exits.
    result = sandbox.commands.run("sleep 30 & echo started", timeout=20)
    assert result.stdout == "started\n"


def test_broken_utf8(sandbox) -> None:
    # Two writes a moment apart, so the "€" is likely split across output chunks; correct either way.
    result = sandbox.commands.run(r"printf '\xe2\x82'; sleep 0.1; printf '\xac ok\xff'")
    assert result.stdout.startswith("€ ok")
    assert result.stdout.endswith("\ufffd")


def test_many_lines_of_output(sandbox) -> None:
    result = sandbox.commands.run("seq 1 20000")
    assert result.stdout.splitlines()[-1] == "20000"
    assert len(result.stdout.splitlines()) == 20000


def test_callbacks_stream(sandbox) -> None:
    seen: list[str] = []
    sandbox.commands.run("echo a; echo b >&2", on_stdout=seen.append, on_stderr=seen.append)
    assert sorted(seen) == ["a\n", "b\n"]


async def test_async_commands(async_sandbox) -> None:
    result = await async_sandbox.commands.run("echo async; whoami", user="root")
    assert result.stdout == "async\nroot\n"
    handle = await async_sandbox.commands.run("cat", background=True, stdin=True)
    await async_sandbox.commands.send_stdin(handle.pid, "x\n")
    await async_sandbox.commands.close_stdin(handle.pid)
    assert (await handle.wait()).stdout == "x\n"
    with pytest.raises(CommandExitException):
        await async_sandbox.commands.run("exit 7")


async def test_async_timeout_is_a_deadline(async_sandbox) -> None:
    # Once the stream is open the async client does not enforce `timeout` itself (on Python 3.11 connectrpc arms
    # that deadline in the task the SDK awaits the start event in, which is done by then): the agent must end the
    # stream with deadline_exceeded, not with the end event of the process it kills.
    handle = await async_sandbox.commands.run("sleep 20", background=True, timeout=1)
    with pytest.raises(TimeoutException):
        await handle.wait()
    # The process did not outlive its deadline: a new stream to it (not bounded by that deadline) sees it killed.
    attached = await async_sandbox.commands.connect(handle.pid, timeout=30)
    with pytest.raises(CommandExitException) as ended:
        await attached.wait()
    assert ended.value.error == "signal: killed"


async def test_async_run_timeout(async_sandbox) -> None:
    with pytest.raises(TimeoutException):
        await async_sandbox.commands.run("sleep 20", timeout=1)


async def test_async_kill_and_connect(async_sandbox) -> None:
    handle = await async_sandbox.commands.run("sleep 30", background=True)
    assert handle.pid in {p.pid for p in await async_sandbox.commands.list()}
    attached = await async_sandbox.commands.connect(handle.pid)
    assert await async_sandbox.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException):
        await attached.wait()


def _wait_for_login_spare(sandbox) -> None:
    """Until the agent has a login spare waiting (made once it has been idle for 0.25 s): a child of the agent whose
    command line is the stub's. The look itself is a command the spare cannot run (an environment variable of its
    own), whose parent is the agent; only the agent's children count (in host mode /proc is the host's, where other
    agents have spares of their own)."""
    look = ("for s in /proc/[0-9]*/status; do grep -qx \"PPid:[[:space:]]*$PPID\" $s 2>/dev/null && "
            "tr '\\0' ' ' < ${s%status}cmdline 2>/dev/null && echo; done; true")
    assert eventually(lambda: "__ks_" in sandbox.commands.run(look, envs={"KS_LOOK": "1"}).stdout,
                      within_s=30, every_s=0.5)


def _timed_run(sandbox, cmd: str, **kwargs):
    """`commands.run`, with the probe's [$SECONDS] checked against the run's window and replaced by `S`: whole
    seconds since the shell started (or the spare set SECONDS=0), 1 where the two fall either side of a second."""
    start = time.time()
    result = sandbox.commands.run(cmd, **kwargs)
    end = time.time()
    m = re.search(r"(\]\[\d+\]\[)(\d+)\]\[", result.stdout)  # [$#][$SECONDS][
    assert m is not None, result.stdout
    assert 0 <= int(m[2]) <= int(end) - int(start), f"SECONDS={m[2]} in a run of {end - start:.2f} s"
    return result.stdout[:m.start(2)] + "S" + result.stdout[m.end(2):], result.stderr


def test_after_an_idle_moment_a_command_runs_in_the_login_spare_and_sees_the_same(sandbox) -> None:
    """agent/spare.py: once the sandbox has been idle for a moment, `commands.run(cmd)` of one simple command is
    run by a login bash that ran its login scripts ahead of time: a builtin's evaluated in it (its
    /proc/PID/cmdline, the one thing that shows it, is the stub's), a program exec'd in its place as bash -c execs
    it. A command with an environment variable of its own cannot use it and starts `bash -l -c` afresh. Both see the
    same shell, and a program the same parent."""
    probe = "/tmp/ks-login-spare-probe.sh"
    sandbox.files.write(probe, (
        "echo \"[$_][$0][$-][$#][$SECONDS][$BASH_EXECUTION_STRING]\"; id; umask; pwd; env | sort; "
        "ls /proc/$$/fd; declare -f; shopt -p; set +o; trap -p; nosuch-command; echo \"[$?]\"; "
        "echo; tr '\\0' ' ' < /proc/$$/cmdline\n"))
    for _ in range(2):
        sandbox.commands.run("true")
        _wait_for_login_spare(sandbox)
        spare, spare_err = _timed_run(sandbox, f"source {probe}")
        fresh, fresh_err = _timed_run(sandbox, f"source {probe}", envs={"KS_PROBE": "1"})
        seen, cmdline = spare.rsplit("\n", 1)
        assert "BASH_EXECUTION_STRING" in cmdline and "__ks_" in cmdline  # the login spare ran it
        fresh_seen, fresh_cmdline = fresh.rsplit("\n", 1)
        assert fresh_cmdline.startswith("/bin/bash -l -c source ")
        assert seen == fresh_seen.replace("KS_PROBE=1\n", "")
        assert spare_err == fresh_err and "nosuch-command: command not found" in spare_err
        assert "[127]" in seen and "uid=" in seen
    parent = "sh -c 'cat /proc/$PPID/comm; ls /proc/self/fd'"
    sandbox.commands.run("true")
    _wait_for_login_spare(sandbox)
    assert sandbox.commands.run(parent).stdout == sandbox.commands.run(parent, envs={"KS_PROBE": "1"}).stdout
