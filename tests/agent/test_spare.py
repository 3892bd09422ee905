"""Spare processes (agent/spare.py): a command started by a spare sees what it would see started through setpriv."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from keepstate.agent.process import SETPRIV, pipe_spawn_argv
from keepstate.agent.spare import PERL, Spare, Spares
from keepstate.agent.users import lookup_user, process_env

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(os.access(p, os.X_OK) for p in (SETPRIV, PERL)),
    reason="spares switch users: root, setpriv and perl needed",
)

# What a command can see of how it was started: ids, groups, capabilities, umask, cwd, env, open fds, ignored
# signals, session and process group, stdin.
PROBE = ("id; grep -E '^(Uid|Gid|Groups|CapPrm|CapEff|SigIgn|SigBlk):' /proc/self/status; umask; pwd; env | sort; "
         "ls /proc/self/fd; ps -o sid=,pgid= -p $$ | awk -v p=$$ '{print ($1==p) ($2==p)}'; cat; echo \"[$0]\"")


def _setpriv_run(argv: list[str], env: dict[str, str], cwd: str, stdin: bytes | None) -> tuple[bytes, bytes, int]:
    user = lookup_user("nobody")
    argv, identity = pipe_spawn_argv(argv, user, env)
    p = subprocess.Popen(argv, **identity, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env, umask=0o022,
                         start_new_session=True, close_fds=True)
    out, err = p.communicate(stdin)
    return out, err, p.returncode


def _spare_run(argv: list[str], env: dict[str, str], cwd: str, stdin: bytes | None) -> tuple[bytes, bytes, int]:
    user = lookup_user("nobody")
    spare = Spare(SETPRIV, user)
    program = argv[0] if "/" in argv[0] else f"/usr/bin/{argv[0]}"
    spare.run([program, *argv[1:]], env, cwd, stdin is not None)
    out, err = spare.popen.communicate(stdin)
    return out, err, spare.popen.returncode


@pytest.mark.parametrize("stdin", [b"some input\n", None])
def test_command_sees_what_setpriv_gives(stdin: bytes | None) -> None:
    env = process_env(lookup_user("nobody"), {"A": "b c", "EMPTY": "", "EQ": "x=y"}, {"LANG": "C.UTF-8"})
    argv = ["/bin/bash", "-l", "-c", PROBE]
    ours, theirs = _spare_run(argv, env, "/tmp", stdin), _setpriv_run(argv, env, "/tmp", stdin)
    assert ours == theirs
    assert b"uid=65534" in ours[0] and b"A=b c" in ours[0] and ours[2] == 0


def test_exec_failure_is_an_exit_status_as_with_setpriv() -> None:
    out, err, code = _spare_run(["/nonexistent/program"], {}, "/", None)
    assert code == 127 and b"/nonexistent/program" in err


def test_stale_or_dead_spares_are_not_used() -> None:
    async def go() -> None:
        user = lookup_user("nobody")
        spares = Spares(SETPRIV)
        spares.prime(user)
        spare = spares._by_uid[user.uid]  # noqa: SLF001
        spare.popen.kill()
        spare.popen.wait()
        assert spares.take(user) is None  # dead: discarded
        spares.prime(user)
        spares._by_uid[user.uid].identity = (user.uid, user.gid, (12345,))  # noqa: SLF001 - groups changed since
        assert spares.take(user) is None
        assert spares.take(user) is None  # and nothing is left
        spares.prime(lookup_user("root"))  # root needs none
        assert spares.take(lookup_user("root")) is None
        spares.close()

    asyncio.run(go())
