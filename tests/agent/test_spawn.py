"""Starting a command as its user with one exec (agent/spawn.py): the child sees what `setpriv` would have given
it, the agent keeps its own directory, umask and identity, and whatever cannot be done this way is left to the
setpriv path."""

from __future__ import annotations

import asyncio
import ctypes
import os
import platform
import re
import tempfile
import threading

import pytest

from keepstate.agent import spawn as spawn_module
from keepstate.agent.process import SETPRIV, ProcessTable, SpawnSpec
from keepstate.agent.proto.process.process_pb import ProcessConfig, ProcessEvent
from keepstate.agent.spawn import Child, spawn
from keepstate.agent.users import identity_of, lookup_user, process_env
from tests.agent.test_spare import PROBE, _setpriv_run

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.access(SETPRIV, os.X_OK),
                                reason="compared with setpriv, as root")

NOBODY = lookup_user("nobody")
# PROBE (ids, groups, capabilities, ignored and blocked signals, umask, cwd, environment, fds, session, stdin, $0),
# the parent, and the signals caught: none (a handler does not survive an exec; glibc's internal signals included).
PROBE_MORE = PROBE + "; echo \"parent $PPID\"; grep -E '^(SigCgt|SigPnd|ShdPnd|NoNewPrivs|CapInh|CapBnd|CapAmb):' " \
    "/proc/self/status"


def _spawned(argv: list[str], env: dict[str, str], cwd: str, stdin: bytes | None) -> tuple[bytes, bytes, int]:
    child = spawn(identity_of(NOBODY), argv, env=env, cwd=cwd, stdin=stdin is not None)
    assert child is not None, "started as the user with one exec"
    out, err = child.communicate(stdin, timeout=30)
    return out, err, child.returncode or 0


@pytest.mark.parametrize("stdin", [b"some input\n", None])
def test_child_sees_what_setpriv_gives(stdin: bytes | None) -> None:
    env = process_env(NOBODY, {"A": "b c", "EMPTY": "", "EQ": "x=y"}, {"LANG": "C.UTF-8"})
    argv = ["/bin/bash", "-l", "-c", PROBE_MORE]
    ours, theirs = _spawned(argv, env, "/tmp", stdin), _setpriv_run(argv, env, "/tmp", stdin)
    assert ours == theirs
    assert b"uid=65534" in ours[0] and f"parent {os.getpid()}\n".encode() in ours[0] and ours[2] == 0


def _raw_sigaction(sig: int, new: ctypes.Array[ctypes.c_ulong] | None) -> ctypes.Array[ctypes.c_ulong]:
    old = (ctypes.c_ulong * 8)()
    number = spawn_module._SYSCALLS[platform.machine()].rt_sigaction  # noqa: SLF001
    assert ctypes.CDLL(None, use_errno=True).syscall(number, sig, new, old, 8) == 0
    return old


@pytest.mark.parametrize("ignored", [True, False])
def test_glibcs_internal_signals_are_inherited_as_through_an_exec(ignored: bool) -> None:
    """An agent that inherited signal 32 ignored (glibc's SIGCANCEL: a CI runner's shell left it so) passes that on,
    as an exec does; one that has it at its default passes the default on, though glibc's posix_spawn would have
    left it ignored."""
    ign = (ctypes.c_ulong * 8)(spawn_module.SIG_IGN)
    dfl = (ctypes.c_ulong * 8)(0)
    old = _raw_sigaction(32, ign if ignored else dfl)
    try:
        argv = ["/bin/sh", "-c", "grep -E '^Sig(Ign|Blk|Cgt):' /proc/self/status"]
        ours, theirs = _spawned(argv, {}, "/", None), _setpriv_run(argv, {}, "/", None)
    finally:
        _raw_sigaction(32, old)
    assert ours == theirs
    ignoring = int(re.search(rb"SigIgn:\t([0-9a-f]+)", ours[0])[1], 16)  # type: ignore[index]
    assert bool(ignoring & (1 << 31)) == ignored and not ignoring & (1 << 32)


def test_the_agent_keeps_its_directory_umask_and_identity() -> None:
    cwd, mask = os.getcwd(), os.umask(0o077)
    try:
        out, _, _ = _spawned(["/bin/sh", "-c", "pwd; umask"], {}, "/tmp", None)
        assert out == b"/tmp\n0022\n"
        assert os.getcwd() == cwd and os.umask(0o077) == 0o077
        assert os.getresuid() == (0, 0, 0) and os.getresgid() == (0, 0, 0)
    finally:
        os.umask(mask)


def test_no_fd_of_the_agent_is_inherited() -> None:
    read, write = os.pipe()
    os.set_inheritable(read, True)
    os.set_inheritable(write, True)
    try:
        out, _, _ = _spawned(["/bin/sh", "-c", "ls /proc/$$/fd"], {}, "/", None)
        assert out.split() == [b"0", b"1", b"2"]
    finally:
        os.close(read)
        os.close(write)


def test_what_cannot_be_done_so_is_left_to_setpriv() -> None:
    with tempfile.TemporaryDirectory() as closed:
        os.chmod(closed, 0o700)  # root's: the user cannot enter it
        assert spawn(identity_of(NOBODY), ["/bin/true"], env={}, cwd=closed, stdin=False) is None
    assert spawn(identity_of(NOBODY), ["/nonexistent/program"], env={}, cwd="/", stdin=False) is None
    assert spawn(identity_of(NOBODY), ["/bin/true"], env={"A": "x\0y"}, cwd="/", stdin=False) is None
    assert _spawned(["/bin/true"], {}, "/", None)[2] == 0  # and the thread still serves


def test_one_thread_per_identity_and_none_where_it_cannot_change(monkeypatch: pytest.MonkeyPatch) -> None:
    for _ in range(3):
        _spawned(["/bin/true"], {}, "/", None)
    names = [t.name for t in threading.enumerate()]
    assert names.count(f"spawn-as-{NOBODY.uid}") == 1
    monkeypatch.setattr(spawn_module, "_threads", {})
    monkeypatch.setattr(spawn_module, "_SYSCALLS", {})  # an architecture without the numbers
    assert spawn(identity_of(NOBODY), ["/bin/true"], env={}, cwd="/", stdin=False) is None


def test_the_process_table_starts_a_users_command_so() -> None:
    """Without spares, a command of a user other than root takes this path; its output and its end (by a signal
    here) reach the stream as before."""
    async def go() -> tuple[bytes, list[str]]:
        table = ProcessTable()
        try:
            spec = SpawnSpec("/bin/bash", ["-l", "-c", "echo $(id -un) $PPID; kill -SEGV $$"],
                             process_env(NOBODY, {}, {}), "/tmp", NOBODY, False, None, None, ProcessConfig())
            proc = table.start(spec, None)
            assert isinstance(proc._popen, Child)  # noqa: SLF001
            queue, out, ends = proc.subscribe(), b"", []
            while (event := await asyncio.wait_for(queue.get(), 30)) is not None:
                if isinstance(event, ProcessEvent) and event.event is not None:
                    if event.event.field == "data":
                        out += event.event.value.output.value
                    elif event.event.field == "end":
                        ends.append(event.event.value.status)
            return out, ends
        finally:
            table.kill_all()

    out, ends = asyncio.run(go())
    assert out == f"nobody {os.getpid()}\n".encode() and ends == ["signal: segmentation fault"]
