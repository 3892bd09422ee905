"""Spare processes (agent/spare.py): a command started by a spare sees what it would see started through setpriv:
the generic spare's exec'd program, and the login spare's `bash -l -c CMD`, evaluated by a login shell that was
waiting for it."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

from keepstate.agent.process import SETPRIV, ProcessTable, SpawnSpec, pipe_spawn_argv
from keepstate.agent.proto.process.process_pb import ProcessConfig, ProcessEvent
from keepstate.agent.spare import PERL, LoginSpare, Spare, Spares, login_mode
from keepstate.agent.users import User, lookup_user, process_env

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
        assert spares.pids() == set()  # a generic spare is made for users whose commands wanted one
        assert spares.take(user) is None
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


# --- login spares ----------------------------------------------------------------------------------------------

@pytest.fixture
def home_user() -> Iterator[User]:
    """`nobody` with a home of its own (login scripts to read and change), readable by nobody."""
    home = tempfile.mkdtemp(prefix="keepstate-spare-home-")
    os.chmod(home, 0o755)
    with open(os.path.join(home, ".profile"), "w") as f:
        f.write('export FROM_PROFILE="one"\nlast_profile_word=done\n: profile-end\n')  # leaves $_
    nobody = lookup_user("nobody")
    yield User(nobody.name, nobody.uid, nobody.gid, home, nobody.shell)
    shutil.rmtree(home)


def _env(user: User) -> dict[str, str]:
    return process_env(user, {"A": "b c", "EMPTY": "", "EQ": "x=y"}, {"LANG": "C.UTF-8"})


def _bash_l_c(user: User, cmd: str) -> tuple[bytes, bytes, int]:
    """What the usual path runs for the SDK's commands.run(cmd)."""
    argv, identity = pipe_spawn_argv(["/bin/bash", "-l", "-c", cmd], user, _env(user))
    start = time.time()
    p = subprocess.Popen(argv, **identity, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,  # noqa: S603
                         stderr=subprocess.PIPE, cwd=user.home, env=_env(user), umask=0o022, start_new_session=True,
                         close_fds=True)
    out, err = p.communicate(timeout=30)
    return _seconds(out, start, time.time()), err, p.returncode


# The probe's $SECONDS (in its first line, [$#][$SECONDS][, and in declare -p): whole seconds since the shell
# started (or the spare set SECONDS=0), so 1 where that moment and the probe fall either side of a second's boundary.
_PROBE_SECONDS = (re.compile(rb"(\]\[\d+\]\[)(\d+)(\]\[)"), re.compile(rb"(^declare -i SECONDS=\")(\d+)(\")", re.M))


def _seconds(out: bytes, start: float, end: float) -> bytes:
    """`out` with the probe's $SECONDS checked against the run's window [start, end] and replaced by `S`."""
    def check(m: re.Match[bytes]) -> bytes:
        assert 0 <= int(m[2]) <= int(end) - int(start), f"SECONDS={m[2]!r} in a run of {end - start:.2f} s"
        return m[1] + b"S" + m[3]
    for pattern in _PROBE_SECONDS:
        out = pattern.sub(check, out, count=1)
    return out


def _login_spare(user: User, cmd: str, wait: float = 0.0, mode: str | None = None) -> tuple[bytes, bytes, int]:
    """`cmd` run by a login spare as the agent runs it (login_mode), or in `mode` (the stub alone)."""
    command = login_mode(["/bin/bash", "-l", "-c", cmd], False) if mode is None else (mode, "", cmd)
    assert command is not None, f"the agent would not run {cmd!r} in a login spare"
    spare = LoginSpare(SETPRIV, user, _env(user), user.home)
    time.sleep(wait)  # the spare waits, as it does for an agent that thinks between commands
    start = time.time()
    spare.run(command, _env(user))
    out, err = spare.popen.communicate(timeout=30)
    return _seconds(out, start, time.time()), err, spare.popen.returncode


# Everything a command can see of its shell: $_ (what the login scripts left), $0, $-, $#, $SECONDS (the spare
# waited over a second), ids, capabilities, signals, umask, cwd, environment, every variable (RANDOM's seed and the
# pids excepted), functions, options, traps, fds, session; then stdin (/dev/null) and $0 again. Sourced (one
# simple command run by a builtin, as the agent sends to a login spare).
PROBE_LOGIN = (
    "echo \"[$_][$0][$-][$#][$SECONDS][$BASH_EXECUTION_STRING]\"; id; "
    "grep -E '^(Uid|Gid|Groups|CapPrm|CapEff|SigIgn|SigBlk|SigCgt):' /proc/self/status; umask; pwd; env | sort; "
    "declare -p | grep -v -e '^declare -i RANDOM' -e '^declare -ir PPID=' -e BASHPID -e '^declare -- _=' "
    "-e '^declare -a BASH_SOURCE' -e '^declare -a BASH_LINENO'; "
    "declare -f; shopt; set -o; trap -p; ls /proc/$$/fd; "
    "ps -o sid=,pgid= -p $$ | awk -v p=$$ '{print ($1==p) ($2==p)}'; "
    "cat; echo \"[$0]\"\n"
)


@pytest.mark.parametrize("cmd", [
    "source {home}/probe.sh",
    "true",
    "exit 7",
    "cd /tmp",
    "nosuch-command with args",  # bash's own message, with bash -c's line number
    "echo \"$FROM_PROFILE $last_profile_word\" $_",  # what the login scripts set and left
    "printf '%s|' \"$BASH_EXECUTION_STRING\" 'x y' é 日本",
    "exec echo replaced",
    # A program: bash -c execs it in its own place (same pid, parent, fds, environment, exit status).
    "env",
    "sh -c 'cat /proc/$PPID/comm; ls /proc/self/fd; echo $0 $# \"$*\"' zero one two",
    "/bin/sh -c 'kill -SEGV $$'",
    "/bin/kill -9 $$",
    "sleep 0.1",
    "sh -c 'echo \"[$0] $*\"' $_ $LINENO ~ ~/x x:~/y {a,b} /proc/self/fd/[0-2]",  # words expanded as bash -c does
])
def test_login_spare_command_sees_what_bash_l_c_gives(home_user: User, cmd: str) -> None:
    with open(os.path.join(home_user.home, "probe.sh"), "w") as f:
        f.write(PROBE_LOGIN)
    cmd = cmd.replace("{home}", home_user.home)
    theirs = _bash_l_c(home_user, cmd)
    ours = _login_spare(home_user, cmd, wait=1.1 if "probe" in cmd else 0.0)
    assert ours == theirs
    if "probe" in cmd:
        assert b"uid=65534" in ours[0] and b"FROM_PROFILE=one" in ours[0]
        assert b"[profile-end][/bin/bash][hBc][0][S][" in ours[0]


@pytest.mark.parametrize("cmd", [
    "echo a\necho $LINENO\nnosuch\n( echo $LINENO; f() { echo $LINENO; caller; }; f )",
    "echo a; )",  # a syntax error: bash -l -c is exec'd, so the message is word for word bash -c's
    "echo a\nif",  # the first line runs, then the syntax error
    "shopt -s extglob\necho @(a|b)",  # parses only once the first line has run
    "cat <<EOF\nhere",  # a here-document to the end
    "",
    "# only a comment",
    "trap 'echo trapped' EXIT; echo x",
])
def test_the_stub_evaluates_what_bash_c_runs_in_itself(home_user: User, cmd: str) -> None:
    """The stub alone, in mode `eval`, with strings the agent does not send it (more than one simple command, whose
    last one bash -c may exec in its own place): line numbers, bash's own syntax errors, here-documents, traps."""
    assert login_mode(["/bin/bash", "-l", "-c", cmd], False) is None
    assert _login_spare(home_user, cmd, mode="eval") == _bash_l_c(home_user, cmd)


def test_a_function_or_alias_of_the_login_scripts_is_run_as_bash_c_runs_it(home_user: User) -> None:
    with open(os.path.join(home_user.home, ".profile"), "a") as f:
        f.write("ls() { echo \"ls was the function: $*\"; }\nshopt -s expand_aliases\nalias cat='echo cat alias'\n")
    for cmd in ("ls /", "cat /etc/hostname"):
        assert _login_spare(home_user, cmd) == _bash_l_c(home_user, cmd)
    assert _login_spare(home_user, "ls /")[0] == b"ls was the function: /\n"


def test_functions_the_login_scripts_define_do_not_stand_in_for_the_stubs_builtins(home_user: User) -> None:
    with open(os.path.join(home_user.home, ".profile"), "a") as f:
        for name in ("read", "eval", "printf", "unset", "exit", ":"):
            f.write(f"{name}() {{ echo '{name} was the function'; }}\n")
    for cmd in ("source /dev/null", "declare -F", "env"):
        assert _login_spare(home_user, cmd) == _bash_l_c(home_user, cmd)
    assert _login_spare(home_user, "echo a; )", mode="eval") == _bash_l_c(home_user, "echo a; )")
    assert _login_spare(home_user, "echo ran")[0] == b"ran\n"


def test_login_spares_seed_random_afresh(home_user: User) -> None:
    """A fork of a sandbox copies its waiting spare: RANDOM is seeded when the command comes, not at the spare's
    start (two spares given the same start would otherwise print the same numbers)."""
    outs = {_login_spare(home_user, "echo $RANDOM $RANDOM $RANDOM")[0] for _ in range(4)}
    assert len(outs) == 4


def test_login_mode_is_the_sdks_bash_l_c_of_one_simple_command_without_stdin() -> None:
    def mode(cmd: str, stdin: bool = False, argv0: str = "/bin/bash") -> str | None:
        found = login_mode([argv0, "-l", "-c", cmd], stdin)
        return None if found is None else found[0]

    assert mode("true") == mode("echo a 'b c' \"$HOME\" *.py ~") == mode("source x") == "eval"
    assert mode("ls -la /tmp") == mode("python3 -c 'print(1)'") == mode("./run.sh a") == "exec"
    for other in ("ls; ls", "ls && ls", "ls | cat", "ls > f", "ls\nls", "echo $(date)", "echo `date`", "X=1 ls",
                  "if true; then :; fi", "{ ls; }", "(ls)", "ls # c", "echo \\x", "echo 'open", "command ls",
                  "[ -f x ]", "-x", "x" * 20000, "ls --out=~/x", "ls [1]=x", "ls 'a[0]+=b'"):
        assert mode(other) is None, other
    assert mode("ls", stdin=True) is None and mode("ls", argv0="/bin/sh") is None


def _spec(user: User, cmd: str, env: dict[str, str], cwd: str) -> SpawnSpec:
    return SpawnSpec(cmd="/bin/bash", args=["-l", "-c", cmd], env=env, cwd=cwd, user=user, stdin=False,
                     pty_size=None, tag=None, config=ProcessConfig())


async def _output(table: ProcessTable, spec: SpawnSpec) -> tuple[int, bytes]:
    proc = table.start(spec, None)
    queue = proc.subscribe()
    out = b""
    while (event := await asyncio.wait_for(queue.get(), 30)) is not None:
        if isinstance(event, ProcessEvent) and event.event is not None and event.event.field == "data":
            out += event.event.value.output.value
    return proc.pid, out


def test_the_agent_runs_default_commands_in_the_login_spare_while_it_is_current(home_user: User) -> None:
    env, cwd = _env(home_user), home_user.home

    async def go() -> None:
        spares = Spares(SETPRIV, defaults=lambda user: (env, cwd))
        table = ProcessTable(spares=spares)
        try:
            spares.prime(home_user)
            login = spares._login[home_user.uid]  # noqa: SLF001
            assert spares.pids() == {login.popen.pid}  # no generic spare until a command needs one
            pid, out = await _output(table, _spec(home_user, "echo $$ $FROM_PROFILE", env, cwd))
            assert (pid, out) == (login.popen.pid, f"{login.popen.pid} one\n".encode())

            # Another environment or directory: not this spare's command, which stays for the next default one.
            spares.prime(home_user)
            login = spares._login[home_user.uid]  # noqa: SLF001
            pid, out = await _output(table, _spec(home_user, "echo $FROM_PROFILE $X", {**env, "X": "x"}, cwd))
            assert pid != login.popen.pid and out == b"one x\n"
            pid, _ = await _output(table, _spec(home_user, "pwd", env, "/"))
            assert pid != login.popen.pid
            spares.prime(home_user)  # such commands came: a generic spare is made too
            assert len(spares.pids()) == 2 and spares._login[home_user.uid] is login  # noqa: SLF001

            # The login scripts changed since the spare read them: it is thrown away, the command sees the change.
            with open(os.path.join(home_user.home, ".profile"), "a") as f:
                f.write('export FROM_PROFILE="two"\n')
            pid, out = await _output(table, _spec(home_user, "echo $FROM_PROFILE", env, cwd))
            assert pid != login.popen.pid and out == b"two\n"
            assert login.popen.poll() is not None  # discarded, reaped

            # The user's groups changed since: thrown away too.
            spares.prime(home_user)
            login = spares._login[home_user.uid]  # noqa: SLF001
            login.identity = (home_user.uid, home_user.gid, (12345,))
            pid, _ = await _output(table, _spec(home_user, "true", env, cwd))
            assert pid != login.popen.pid
        finally:
            table.kill_all()

    asyncio.run(go())


def test_a_login_spare_made_for_old_defaults_is_replaced(home_user: User) -> None:
    defaults = {"env": _env(home_user)}

    async def go() -> None:
        spares = Spares(SETPRIV, defaults=lambda user: (defaults["env"], home_user.home))
        try:
            spares.prime(home_user)
            first = spares._login[home_user.uid]  # noqa: SLF001
            spares.prime(home_user)
            assert spares._login[home_user.uid] is first  # still current: kept  # noqa: SLF001
            defaults["env"] = {**defaults["env"], "NEW": "1"}  # /init changed the sandbox's environment
            spares.prime(home_user)
            assert spares._login[home_user.uid] is not first and first.popen.poll() is not None  # noqa: SLF001
        finally:
            spares.close()

    asyncio.run(go())
