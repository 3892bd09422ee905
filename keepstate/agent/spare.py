"""Spare processes: a child started ahead of time as a user, waiting to become that user's next command.

Under gVisor (systrap) every exec costs 10-20 ms, and running a command as another user costs one more: the agent
(root) cannot change identity after a vfork, so it runs `setpriv ... -- bash -l -c CMD` (process.pipe_spawn_argv),
two execs on the command's path. A spare does the first of them before the command arrives: it is
`setpriv --reuid --regid --groups -- perl -e STUB`, started with the agent's usual Popen arguments (new
session, umask 022, stdin/stdout/stderr pipes to the agent), and its stub blocks reading a control pipe. When a
command comes, the agent writes the command's argv, environment, working directory and whether it has stdin; the
stub sets that up and execs it. What runs is then the process `setpriv` would have started, in every respect the
command can see: the same pid as the Popen child (the agent's own child, reaped as before), session, ids and
groups, umask, environment (execve'd exactly, nothing of the stub's), cwd, fds 0-2 only, default SIGPIPE/SIGXFSZ.
Only the exec of the command itself is left on the command's path.

One spare per user, made after /init and again once the sandbox has been idle for IDLE_S after a command: making
one costs ~45 ms of the sandbox's CPU (setpriv, then perl), more than it saves, so a spare made while commands
follow each other back to back would slow the next of them down (measured: every command ~30 ms slower). Agents
think between commands; back-to-back commands take the usual path. A spare whose identity no longer matches the
user's (a group was added since) is thrown away, never used. PTY processes do not use spares.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Sequence

from keepstate.agent.users import User

# The stub, in Perl (perl-base is Essential in Debian): its start-up costs ~30 ms under gVisor, Python's (-I -S)
# ~55 ms. Core builtins only (no `use`). It names itself `keepstate-spare` in `ps`.
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
IDLE_S = 0.25  # after a command's end with no other command started since: make the next spare


def _argv(setpriv: str | Sequence[str]) -> list[str]:
    return [setpriv] if isinstance(setpriv, str) else list(setpriv)


def identity_of(user: User) -> tuple[int, int, tuple[int, ...]]:
    return user.uid, user.gid, tuple(os.getgrouplist(user.name, user.gid))


def encode(argv: list[str], env: dict[str, str], cwd: str, stdin: bool) -> bytes:
    fields = [b"1" if stdin else b"0", os.fsencode(cwd), str(len(argv)).encode(), *map(os.fsencode, argv),
              *(os.fsencode(f"{k}={v}") for k, v in env.items())]
    if any(b"\0" in f for f in fields):
        raise ValueError("embedded null byte")
    body = b"\0".join(fields)
    return len(body).to_bytes(8, "big") + body


class Spare:
    """One waiting child; `popen` is the command's Popen once `run` has been called."""

    def __init__(self, setpriv: str | Sequence[str], user: User) -> None:
        self.identity = identity_of(user)
        uid, gid, groups = self.identity
        read_end, self._ctl = os.pipe()
        try:
            self.popen = subprocess.Popen(  # noqa: S603 - our own stub, as the user
                [*_argv(setpriv), f"--reuid={uid}", f"--regid={gid}", f"--groups={','.join(map(str, groups))}", "--",
                 PERL, "-e", STUB, str(read_end)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, pass_fds=(read_end,),
                cwd="/", env={}, umask=0o022, start_new_session=True, close_fds=True,
            )
        except BaseException:
            os.close(self._ctl)
            raise
        finally:
            os.close(read_end)

    def alive(self) -> bool:
        return self.popen.poll() is None  # before anyone watches it: a dead spare is reaped here, and dropped

    def run(self, argv: list[str], env: dict[str, str], cwd: str, stdin: bool) -> None:
        """Become the command. Raises OSError if the spare is gone (the caller discards it)."""
        data = encode(argv, env, cwd, stdin)
        try:
            view = memoryview(data)
            while view:  # the pipe holds 64 KiB; a larger request blocks only until the stub reads
                view = view[os.write(self._ctl, view):]
        finally:
            os.close(self._ctl)
        if not stdin and self.popen.stdin is not None:
            self.popen.stdin.close()
            self.popen.stdin = None

    def discard(self) -> None:
        os.close(self._ctl)  # the stub reads EOF and exits
        for f in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if f is not None:
                f.close()
        try:
            self.popen.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


class Spares:
    """At most one spare per user, refilled when taken."""

    def __init__(self, setpriv: str | Sequence[str]) -> None:
        """`setpriv`: its path, or the argv prefix that runs it (the agent runtime's, through its loader)."""
        self._setpriv = _argv(setpriv)
        self._by_uid: dict[int, Spare] = {}
        self._timer: asyncio.TimerHandle | None = None

    def prime(self, user: User) -> None:
        """Have a spare ready for `user` (root needs none: the agent starts its commands without an identity
        change)."""
        if user.uid == 0 or user.uid in self._by_uid or os.geteuid() != 0 or not all(
                os.access(p, os.X_OK) for p in (self._setpriv[0], self._setpriv[-1], PERL)):
            return
        try:
            self._by_uid[user.uid] = Spare(self._setpriv, user)
        except OSError:
            pass  # no spare: commands take the usual path

    def prime_when_idle(self, user: User) -> None:
        """`prime(user)` once IDLE_S pass without a command starting."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(IDLE_S, self.prime, user)

    def pids(self) -> set[int]:
        return {spare.popen.pid for spare in self._by_uid.values()}

    def take(self, user: User) -> Spare | None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        spare = self._by_uid.pop(user.uid, None)
        if spare is None:
            return None
        if spare.identity != identity_of(user) or not spare.alive():
            spare.discard()
            return None
        return spare

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for spare in self._by_uid.values():
            spare.discard()
        self._by_uid.clear()
