"""Spare processes: a child started ahead of time as a user, waiting to become that user's next command.

Under gVisor (systrap) every exec costs 10-20 ms. A command as another user takes one exec (spawn.py: posix_spawn
from a thread that holds the user's identity), or two where that cannot be done (`setpriv ... -- bash -l -c CMD`,
process.pipe_spawn_argv). Spares take the command's exec off its path; there are two kinds
(docs/design/command-path.md); both are started the same way (spawn.py, else through setpriv):

* A **login spare** is the login shell itself: `/bin/bash -l -c LOGIN_STUB` as the user, started with exactly
  what the SDK's usual command gets (the default environment and working directory, stdin on /dev/null, stdout and
  stderr pipes to the agent, new session, umask 022). bash runs the login scripts, then the stub blocks reading a
  pipe. A `bash -l -c CMD` request with that same environment and directory and no stdin (what `commands.run(cmd)`
  sends), where CMD is one simple command (login_mode), is written to it: a program is exec'd in the shell's place
  as bash -c execs it, a builtin is evaluated in the shell as bash -c does: no process is started on the command's
  path but the program's own exec. What the command sees is what `bash -l -c CMD` gives it ($0, $-, $_,
  $BASH_EXECUTION_STRING, $SECONDS, variables, functions, fds, pid, parent, ids, session, environment, exit status:
  tests/agent/test_spare.py compares them byte for byte); what differs is written down in command-path.md (a
  builtin's /proc/PID/cmdline shows the stub; the login scripts ran before the command came). A login spare is used
  only while its user's ids, its environment and directory, and the login scripts it read (their inode, size and
  times) are unchanged; otherwise it is thrown away and made again.
* A **generic spare** is `perl -e STUB` as the user: for any other command, it receives argv, environment, cwd
  and whether there is stdin, sets them up and execs the command (the same process setpriv would have started).

Spares are made after /init (a login spare) and once the sandbox has been idle for IDLE_S after a command (the
login spare, and the generic one once a command of that user could not use the login spare): making one costs
~25-45 ms of the sandbox's CPU, so spares made while commands follow each other back to back would slow the next of
them down (measured: every command ~30 ms slower). PTY processes and root's commands do not use spares.
"""

from __future__ import annotations

import asyncio
import glob
import os
import re
import secrets
import subprocess
from collections.abc import Callable, Sequence

from keepstate.agent.spawn import Started, spawn
from keepstate.agent.users import User, files_state, identity_of, setpriv_flags

# The generic stub, in Perl (perl-base is Essential in Debian): its start-up costs ~30 ms under gVisor, Python's
# (-I -S) ~55 ms. Core builtins only (no `use`). It names itself `keepstate-spare` in `ps`.
STUB = r"""
$0 = "keepstate-spare";
open(my $c, "<&=", $ARGV[0]) or exit 0;
my $buf = "";
while (length($buf) < 8 || length($buf) < 8 + unpack("Q>", $buf)) {
    sysread($c, $buf, 65536, length($buf)) or exit 0;
}
close($c);
my @p = split(/\0/, substr($buf, 8, unpack("Q>", $buf)), -1);
my ($stdin, $cwd, $argc) = splice(@p, 0, 3);
my @argv = splice(@p, 0, $argc);
%ENV = ();
for (@p) { my ($k, $v) = split(/=/, $_, 2); $ENV{$k} = $v; }
open(STDIN, "<", "/dev/null") if $stdin eq "0";
$SIG{PIPE} = $SIG{XFSZ} = "DEFAULT";
chdir($cwd) and exec { $argv[0] } @argv;
my $code = $!{ENOENT} ? 127 : 126;
print STDERR "setpriv: failed to execute $argv[0]: $!\n";
exit $code;
"""
PERL = "/usr/bin/perl"
BASH, ENV = "/bin/bash", "/usr/bin/env"

# The login stub, one line so that the command's line numbers are bash -c's. It gets a seed for RANDOM, a mode, the
# command's first word and the command (each NUL-terminated; the command into BASH_EXECUTION_STRING, where bash -c
# keeps it), then the environment. It keeps $_ as the login scripts left it (what bash -c CMD sees first). A command
# that does not parse as a function body (nothing is evaluated), or whose first word is a function or an alias of
# the login scripts in mode `exec`, gets `bash -l -c CMD` exec'd afresh with exactly the environment sent (so bash
# itself prints a syntax error). Else the stub closes the pipe, drops the probe function, restarts SECONDS, seeds
# RANDOM (a fork of the sandbox copies a waiting spare; $SRANDOM would show in `declare -p`) and puts the command's
# words in an array whose expansion is the stub's last command:
# - mode `exec` (one simple command run by a program, login_mode): the command's own words, expanded as bash -c
#   would expand them. bash -c execs the last simple command of its string in its own place (same pid, parent, fds,
#   exit status; `_` put last in the environment), and that command is now the stub's own last one;
# - mode `eval` (one run by a builtin): an eval that unsets the stub's variables, puts $_ back and evaluates the
#   command in the shell, as bash -c does.
# Builtins are called as `builtin X` (the login scripts may have defined a function of that name), but for the
# `exec` that closes the pipe: a redirection on `builtin exec` is undone after it.
LOGIN_STUB = (
    "__ks_=$_; builtin read -r -d '' -u FD __ks_r && builtin read -r -d '' -u FD __ks_m "
    "&& builtin read -r -d '' -u FD __ks_w && IFS= builtin read -r -d '' -u FD BASH_EXECUTION_STRING "
    "|| builtin exit 0; "
    "if [[ $__ks_m == exec ]] && { builtin declare -F -- \"$__ks_w\" >/dev/null "
    "|| [[ -n ${BASH_ALIASES[$__ks_w]+x} ]]; }; then __ks_m=bash; fi; "
    "if [[ $__ks_m == bash ]] || ! { builtin eval \"__ks_f() { $BASH_EXECUTION_STRING\"$'\\n}'; } 2>/dev/null; "
    "then __ks_e=(); while IFS= builtin read -r -d '' -u FD __ks_v; do __ks_e+=(\"$__ks_v\"); done; "
    "builtin exec " + ENV + " -i -- \"${__ks_e[@]}\" " + BASH + " -l -c \"$BASH_EXECUTION_STRING\" FD<&-; fi; "
    "exec FD<&-; builtin unset -f __ks_f; SECONDS=0; RANDOM=$__ks_r; "
    "if [[ $__ks_m == exec ]]; then builtin : \"$__ks_\"; builtin eval \"__ks_a=( $BASH_EXECUTION_STRING )\"; "
    "else builtin printf -v __ks_ %q \"$__ks_\"; __ks_a=(builtin eval \"builtin unset __ks_ __ks_r __ks_m __ks_w "
    "__ks_a; builtin : $__ks_; builtin eval \\\"\\$BASH_EXECUTION_STRING\\\"\"); fi; "
    "\"${__ks_a[@]}\""
)
LOGIN_MAX = 16384  # bash reads a pipe a byte at a time: a longer command takes the generic path
IDLE_S = 0.25  # after a command's end with no other command started since: make the next spares

Defaults = Callable[[User], tuple[dict[str, str], str]]  # a user's default command environment and directory


def _argv(setpriv: str | Sequence[str]) -> list[str]:
    return [setpriv] if isinstance(setpriv, str) else list(setpriv)


def login_scripts(user: User) -> tuple[str, ...]:
    """The files a login bash reads (Debian's chain). A file added to /etc/profile.d changes the directory's times."""
    home = user.home.rstrip("/")
    return ("/etc/profile", "/etc/bash.bashrc", "/etc/profile.d", *sorted(glob.glob("/etc/profile.d/*.sh")),
            *(f"{home}/{name}" for name in (".bash_profile", ".bash_login", ".profile", ".bashrc")))


def encode(argv: list[str], env: dict[str, str], cwd: str, stdin: bool) -> bytes:
    fields = [b"1" if stdin else b"0", os.fsencode(cwd), str(len(argv)).encode(), *map(os.fsencode, argv),
              *(os.fsencode(f"{k}={v}") for k, v in env.items())]
    if any(b"\0" in f for f in fields):
        raise ValueError("embedded null byte")
    body = b"\0".join(fields)
    return len(body).to_bytes(8, "big") + body


def encode_login(mode: str, word: str, cmd: str, env: dict[str, str]) -> bytes:
    fields = [str(secrets.randbits(31)).encode(), mode.encode(), os.fsencode(word), os.fsencode(cmd),
              *(os.fsencode(f"{k}={v}") for k, v in env.items())]
    if any(b"\0" in f for f in fields):
        raise ValueError("embedded null byte")
    return b"".join(f + b"\0" for f in fields)


class _Waiting:
    """A child started as `user` with a control pipe's read end; `popen` is the command's process once `run` was
    called. Started by spawn.py (one exec), else through setpriv."""

    def __init__(self, setpriv: Sequence[str], user: User, argv: list[str], read_end: int, ctl: int, *,
                 stdin: bool, cwd: str, env: dict[str, str]) -> None:
        self._ctl = ctl
        try:
            started = spawn(identity_of(user), argv, env=env, cwd=cwd, stdin=stdin, pass_fd=(read_end, read_end))
            self.popen: Started = started if started is not None else subprocess.Popen(  # noqa: S603 - our stub
                [*setpriv, *setpriv_flags(user), *argv], stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, pass_fds=(read_end,), cwd=cwd, env=env,
                umask=0o022, start_new_session=True, close_fds=True,
            )
        except BaseException:
            os.close(ctl)
            raise
        finally:
            os.close(read_end)

    def alive(self) -> bool:
        return self.popen.poll() is None  # before anyone watches it: a dead spare is reaped here, and dropped

    def _send(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:  # the pipe holds 64 KiB; a larger request blocks only until the stub reads
                view = view[os.write(self._ctl, view):]
        finally:
            self._close_ctl()

    def _close_ctl(self) -> None:
        if self._ctl >= 0:
            os.close(self._ctl)  # the stub reads EOF (and exits, if it was waiting)
            self._ctl = -1

    def discard(self) -> None:
        self._close_ctl()
        for f in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if f is not None:
                f.close()
        try:
            self.popen.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


class Spare(_Waiting):
    """A generic spare: any program, environment, directory and stdin."""

    def __init__(self, setpriv: str | Sequence[str], user: User) -> None:
        self.identity = identity_of(user)
        read_end, ctl = os.pipe()
        super().__init__(_argv(setpriv), user, [PERL, "-e", STUB, str(read_end)], read_end, ctl, stdin=True, cwd="/",
                         env={})

    def run(self, argv: list[str], env: dict[str, str], cwd: str, stdin: bool) -> None:
        """Become the command. Raises OSError if the spare is gone (the caller discards it)."""
        self._send(encode(argv, env, cwd, stdin))
        if not stdin and self.popen.stdin is not None:
            self.popen.stdin.close()
            self.popen.stdin = None


class LoginSpare(_Waiting):
    """A login bash that has run its login scripts with `env` in `cwd`, waiting for a `bash -l -c` command."""

    def __init__(self, setpriv: str | Sequence[str], user: User, env: dict[str, str], cwd: str) -> None:
        self.identity, self.env, self.cwd = identity_of(user), dict(env), cwd
        self.scripts = login_scripts(user)
        self.scripts_state = files_state(self.scripts)
        read_end, ctl = os.pipe()
        super().__init__(_argv(setpriv), user, [BASH, "-l", "-c", LOGIN_STUB.replace("FD", str(read_end))], read_end,
                         ctl, stdin=False, cwd=cwd, env=env)

    def fits(self, user: User, env: dict[str, str], cwd: str) -> bool:
        return (env == self.env and cwd == self.cwd and self.identity == identity_of(user)
                and self.scripts_state == files_state(self.scripts) and self.alive())

    def run(self, command: tuple[str, str, str], env: dict[str, str]) -> None:
        """Become `bash -l -c CMD` (`command`: login_mode's). Raises OSError if the spare is gone (the caller
        discards it)."""
        self._send(encode_login(*command, env))


# bash 5.2's builtins (`compgen -b`) but `command`, whose program bash -c execs in its own place as it does a
# program's, and its reserved words (`compgen -k`).
_BUILTINS = frozenset(
    ". : [ alias bg bind break builtin caller cd compgen complete compopt continue declare dirs disown echo enable "
    "eval exec exit export false fc fg getopts hash help history jobs kill let local logout mapfile popd printf "
    "pushd pwd read readarray readonly return set shift shopt source suspend test times trap true type typeset "
    "ulimit umask unalias unset wait".split())
_KEYWORDS = frozenset("if then else elif fi case esac for select while until do done in function time { } ! [[ ]] "
                      "coproc".split())
# Words that a command and an array assignment (mode `exec` expands the words in one) expand differently: a tilde
# after `=` (`--out=~/x`: a command's argument has it expanded, an array's element not) and `[i]=x` (an element
# assignment in an array).
_ARRAY_DIFFERS = re.compile(r"=~|\]\+?=")
_FIRST = re.compile(r"[ \t]*([A-Za-z0-9_./+][A-Za-z0-9_./+-]*)(?:[ \t]|$)")


def _one_simple_command(cmd: str) -> bool:
    """Whether `cmd` is, for certain, one simple command with no redirection: no unquoted operator, newline,
    comment or escape, no command substitution anywhere, quotes closed. Doubt answers False."""
    if "$(" in cmd or "`" in cmd or "\\" in cmd:
        return False
    quote = ""
    for ch in cmd:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in ";&|<>()\n#":
            return False
    return not quote


def login_mode(argv: list[str], stdin: bool) -> tuple[str, str, str] | None:
    """(mode, first word, command) for a request a login spare can run, the SDK's `/bin/bash -l -c CMD` with no
    stdin where CMD is one simple command whose first word is a plain word: mode `eval` when a builtin runs it
    (bash -c runs it in itself), `exec` when a program does (bash -c execs the program in its own place). None for
    anything else, which the generic spare or the usual path runs."""
    if stdin or len(argv) != 4 or argv[:3] != [BASH, "-l", "-c"]:
        return None
    cmd = argv[3]
    match = _FIRST.match(cmd)
    if len(cmd) > LOGIN_MAX or "\0" in cmd or match is None or not _one_simple_command(cmd):
        return None
    word = match.group(1)
    if word in _KEYWORDS or word == "command" or _ARRAY_DIFFERS.search(cmd):
        return None
    return ("eval" if word in _BUILTINS else "exec"), word, cmd


class Spares:
    """Per user at most one login spare and one generic spare, made again once the sandbox is idle."""

    def __init__(self, setpriv: str | Sequence[str], defaults: Defaults | None = None) -> None:
        """`setpriv`: its path, or the argv prefix that runs it (the agent runtime's, through its loader).
        `defaults`: a user's default environment and directory (no login spares without it)."""
        self._setpriv = _argv(setpriv)
        self._defaults = defaults
        self._by_uid: dict[int, Spare] = {}
        self._login: dict[int, LoginSpare] = {}
        self._generic_wanted: set[int] = set()  # users who ran a command a login spare could not run
        self._timer: asyncio.TimerHandle | None = None

    def _can(self, user: User, *programs: str) -> bool:
        return user.uid != 0 and os.geteuid() == 0 and all(
            os.access(p, os.X_OK) for p in (self._setpriv[0], self._setpriv[-1], *programs))

    def prime(self, user: User) -> None:
        """Have a login spare ready for `user`, and a generic one if that user has wanted one (root needs none:
        the agent starts its commands without an identity change)."""
        self._prime_login(user)
        if user.uid in self._generic_wanted and user.uid not in self._by_uid and self._can(user, PERL):
            try:
                self._by_uid[user.uid] = Spare(self._setpriv, user)
            except OSError:
                pass  # no spare: commands take the usual path

    def _prime_login(self, user: User) -> None:
        if self._defaults is None or not self._can(user, BASH, ENV):
            return
        env, cwd = self._defaults(user)
        old = self._login.get(user.uid)
        if old is not None:
            if old.fits(user, env, cwd):
                return
            del self._login[user.uid]
            old.discard()
        if not os.path.isdir(cwd):
            return
        try:
            self._login[user.uid] = LoginSpare(self._setpriv, user, env, cwd)
        except OSError:
            pass

    def prime_when_idle(self, user: User) -> None:
        """`prime(user)` once IDLE_S pass without a command starting."""
        self._cancel_timer()
        self._timer = asyncio.get_running_loop().call_later(IDLE_S, self.prime, user)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def pids(self) -> set[int]:
        return {spare.popen.pid for spare in (*self._by_uid.values(), *self._login.values())}

    def take_login(self, user: User, env: dict[str, str], cwd: str) -> LoginSpare | None:
        """The user's login spare if it was made for exactly this environment and directory and is still good."""
        self._cancel_timer()
        spare = self._login.get(user.uid)
        if spare is None or env != spare.env or cwd != spare.cwd:
            return None  # kept: the next default command may use it
        del self._login[user.uid]
        if not spare.fits(user, env, cwd):
            spare.discard()
            return None
        return spare

    def takes_default(self, user: User, env: dict[str, str], cwd: str) -> bool:
        """Whether a command with this environment and directory is one a login spare is made for."""
        return self._defaults is not None and self._defaults(user) == (env, cwd)

    def take(self, user: User, *, wanted: bool = True) -> Spare | None:
        """The user's generic spare. `wanted`: a login spare could not have run this command, so have a generic
        spare made for this user from now on."""
        self._cancel_timer()
        if wanted:
            self._generic_wanted.add(user.uid)
        spare = self._by_uid.pop(user.uid, None)
        if spare is None:
            return None
        if spare.identity != identity_of(user) or not spare.alive():
            spare.discard()
            return None
        return spare

    def close(self) -> None:
        self._cancel_timer()
        for spare in (*self._by_uid.values(), *self._login.values()):
            spare.discard()
        self._by_uid.clear()
        self._login.clear()
