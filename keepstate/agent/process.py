"""Processes started through the Process API: spawning (pipes or a PTY), output fan-out, input, signals, exit.

One `ManagedProcess` per child. Output is pushed to every subscribed stream (Start, Connect) as `ProcessEvent`s;
a stream that goes away does not affect the process. Exited processes stay in the table for `RETAIN_EXITED_S`
so a late `Connect` still gets start + end.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import shutil
import signal
import struct
import subprocess
import termios
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypedDict

from keepstate.agent.journal import Journal
from keepstate.agent.own_tools import IMAGE_SETPRIV, setpriv_command
from keepstate.agent.process_events import ExitInfo, data_event, end_event, exit_info
from keepstate.agent.proto.process.process_pb import ProcessConfig, ProcessEvent, ProcessInfo
from keepstate.agent.reaper import REAPER, ChildReaper
from keepstate.agent.spare import Spares, login_mode
from keepstate.agent.spawn import Started, spawn
from keepstate.agent.users import User, group_list, identity_of, setpriv_flags

RETAIN_EXITED_S = 30.0
# After the child exits, wait this long for its pipes to reach EOF: a background grandchild that inherited
# stdout would otherwise hold the stream open forever (envd behaves the same way from the caller's view).
DRAIN_GRACE_S = 0.2
READ_CHUNK = 65536
OUTPUT_ENTRIES = 20  # process.output journal entries per process (then one `truncated`)
OUTPUT_BYTES = 4096  # characters of output journaled per process

class ProcessError(Exception):
    """Base for errors the Process API reports; `code` is the Connect code name."""

    code = "internal"


class ProcessNotFound(ProcessError):
    code = "not_found"


class InvalidProcessRequest(ProcessError):
    code = "invalid_argument"




@dataclass(frozen=True)
class SpawnSpec:
    cmd: str
    args: list[str]
    env: dict[str, str]
    cwd: str
    user: User
    stdin: bool
    pty_size: tuple[int, int] | None  # (cols, rows)
    tag: str | None
    config: ProcessConfig  # as requested, echoed by List


def _set_nonblocking(fd: int) -> None:
    os.set_blocking(fd, False)


def _winsize(cols: int, rows: int) -> bytes:
    return struct.pack("HHHH", rows, cols, 0, 0)


def _make_controlling_tty() -> None:  # runs in the child between fork and exec
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class PopenIdentity(TypedDict, total=False):
    """Popen's arguments that change who the child runs as; empty to run it as the agent's own user."""

    user: int
    group: int
    extra_groups: list[int]


class _PopenCommon(TypedDict):
    cwd: str
    env: dict[str, str]
    umask: int
    start_new_session: bool
    close_fds: bool


def _identity_kwargs(user: User) -> PopenIdentity:
    if os.geteuid() != 0 or user.uid == os.geteuid():
        return {}  # unprivileged (dev runs) we can only run as ourselves; as ourselves, nothing to change
    return {"user": user.uid, "group": user.gid, "extra_groups": group_list(user.name, user.gid)}


SETPRIV = IMAGE_SETPRIV  # the image's; the agent prefers the runtime's (own_tools.setpriv_command)
_setpriv: list[str] | None | bool = False  # False: not looked up yet


def setpriv() -> list[str] | None:
    """The argv prefix that runs setpriv (the agent runtime's, else the image's), None without one."""
    global _setpriv
    if _setpriv is False:
        _setpriv = setpriv_command()
    return _setpriv if isinstance(_setpriv, list) else None


def _has_setpriv() -> bool:
    return setpriv() is not None


# The SDK runs every command as `/bin/bash -l -c CMD`; busybox and alpine images have no bash, only a POSIX sh.
SDK_SHELL, FALLBACK_SHELL = "/bin/bash", "/bin/sh"


def shell_fallback(argv: list[str]) -> list[str]:
    """`argv` with the SDK's /bin/bash replaced by /bin/sh on an image that has no bash (agent-runtime.md)."""
    if argv and argv[0] == SDK_SHELL and not os.path.lexists(SDK_SHELL) and os.path.exists(FALLBACK_SHELL):
        return [FALLBACK_SHELL, *argv[1:]]
    return argv


def _resolve_program(cmd: str, env: dict[str, str]) -> str:
    """What exec would run, checked up front: behind setpriv a missing program would only be an exit status."""
    if "/" in cmd:
        if not os.path.exists(cmd):
            raise ProcessError(f"error starting process '{cmd}': No such file or directory")
        return cmd
    found = shutil.which(cmd, path=env.get("PATH", ""))
    if found is None:
        raise ProcessError(f"error starting process '{cmd}': executable file not found in $PATH")
    return found


def pipe_spawn_argv(argv: list[str], user: User, env: dict[str, str]) -> tuple[list[str], PopenIdentity]:
    """argv and Popen identity arguments to run `argv` as `user`, where spawn.py cannot (one exec fewer; sudo's
    commands, which are root's or another user's, still come here).

    Python's subprocess falls back from vfork to fork when asked to change uid/gid/groups, and a fork of the agent
    costs 25-35 ms in gVisor, during which the event loop waits for the child's exec. `setpriv` (util-linux)
    changes identity after a vfork instead: about 15 ms less per command, and the loop is free after ~3 ms. It sets
    real, effective and saved ids, so no root is left to regain (test_user_has_no_root_left)."""
    identity = _identity_kwargs(user)
    command = setpriv()
    if not identity or command is None:
        return argv, identity
    return [*command, *setpriv_flags(user), _resolve_program(argv[0], env), *argv[1:]], {}


class ManagedProcess:
    def __init__(self, spec: SpawnSpec, loop: asyncio.AbstractEventLoop, spares: Spares | None = None) -> None:
        self.spec = spec
        self._spares = spares
        self._refill = False  # a spare's user: have the next spare made once the sandbox is idle
        self.tag = spec.tag
        self._loop = loop
        self._subscribers: set[asyncio.Queue[ProcessEvent | None]] = set()
        self._readers: dict[int, str] = {}  # fd -> "stdout" | "stderr" | "pty"
        self._stdin_fd: int | None = None
        self._pty_fd: int | None = None
        self._input_lock = asyncio.Lock()
        self._exit: ExitInfo | None = None
        self._end: ProcessEvent | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self.expired = False  # killed because the deadline of the Start request that made it passed
        self._grace: asyncio.TimerHandle | None = None
        self.ended = asyncio.Event()
        self.on_end: Callable[[ManagedProcess], None] | None = None  # before any stream sees the end event
        self.on_output: Callable[[str, bytes], None] | None = None  # each chunk read, with its stream's name
        self._popen = self._spawn()
        self.pid = self._popen.pid

    # --- lifecycle -------------------------------------------------------------------------------------------
    def _spawn(self) -> Started:
        spec = self.spec
        common: _PopenCommon = {
            "cwd": spec.cwd, "env": spec.env, "umask": 0o022, "start_new_session": True, "close_fds": True,
        }
        argv = shell_fallback([spec.cmd, *spec.args])
        try:
            if spec.pty_size is not None:
                return self._spawn_pty(argv, common, _identity_kwargs(spec.user))
            popen: Started | None = self._from_spare(argv) or self._as_user(argv)
            if popen is None:
                argv, identity = pipe_spawn_argv(argv, spec.user, spec.env)
                popen = subprocess.Popen(  # noqa: S603 - running the caller's command is the point
                    argv, **identity, stdin=subprocess.PIPE if spec.stdin else subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, **common,
                )
        except OSError as e:
            raise ProcessError(f"error starting process '{spec.cmd}': {e.strerror or e}") from e
        assert popen.stdout is not None and popen.stderr is not None
        # Keep raw fds; drop the file objects so their finalizers don't close them under us.
        out, err = os.dup(popen.stdout.fileno()), os.dup(popen.stderr.fileno())
        popen.stdout.close()
        popen.stderr.close()
        if popen.stdin is not None:
            self._stdin_fd = os.dup(popen.stdin.fileno())
            popen.stdin.close()
            _set_nonblocking(self._stdin_fd)
        for fd, kind in ((out, "stdout"), (err, "stderr")):
            self._add_reader(fd, kind)
        return popen

    def _as_user(self, argv: list[str]) -> Started | None:
        """The command started as its user by a thread of that identity (spawn.py: one exec, setpriv's none).
        None for a command of the agent's own user, or where that cannot be done: the setpriv path."""
        user = self.spec.user
        if os.geteuid() != 0 or user.uid == 0:
            return None
        program = _resolve_program(argv[0], self.spec.env)  # as pipe_spawn_argv: an unknown program is an error
        return spawn(identity_of(user), [program, *argv[1:]], env=self.spec.env, cwd=self.spec.cwd,
                     stdin=self.spec.stdin)

    def _from_spare(self, argv: list[str]) -> Started | None:
        """The command started by one of the user's spares (spare.py): the login spare for the SDK's `bash -l -c CMD`
        of one simple command with the default environment and directory (no exec but the program's own), else the
        generic spare (what `setpriv` would have started, one exec sooner). None when there is no usable spare
        (root, no setpriv, a stale or dead one): the usual path."""
        spec = self.spec
        if self._spares is None or os.geteuid() != 0 or spec.user.uid == 0 or not _has_setpriv():
            return None
        program = _resolve_program(argv[0], spec.env)  # as pipe_spawn_argv: an unknown program is an error
        self._refill = True
        cmd = login_mode(argv, spec.stdin)
        login = self._spares.take_login(spec.user, spec.env, spec.cwd) if cmd is not None else None
        if login is not None and cmd is not None:
            try:
                login.run(cmd, spec.env)
            except OSError:
                login.discard()
            else:
                return login.popen
        wanted = cmd is None or not self._spares.takes_default(spec.user, spec.env, spec.cwd)
        spare = self._spares.take(spec.user, wanted=wanted)
        if spare is None:
            return None
        try:
            spare.run([program, *argv[1:]], spec.env, spec.cwd, spec.stdin)
        except OSError:
            spare.discard()
            return None
        return spare.popen

    def _spawn_pty(self, argv: list[str], common: _PopenCommon, identity: PopenIdentity) -> subprocess.Popen[bytes]:
        cols, rows = self.spec.pty_size or (80, 24)
        master, slave = os.openpty()
        try:
            fcntl.ioctl(slave, termios.TIOCSWINSZ, _winsize(cols, rows))
            if os.geteuid() == 0:
                os.fchown(slave, self.spec.user.uid, -1)  # like grantpt: the terminal belongs to its user
            popen = subprocess.Popen(  # noqa: S603
                argv, stdin=slave, stdout=slave, stderr=slave, preexec_fn=_make_controlling_tty, **common, **identity,
            )
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        self._pty_fd = master
        self._add_reader(master, "pty")
        return popen

    def start(self, reaper: ChildReaper, deadline: float | None) -> None:
        """`deadline` (event-loop time) is that of the Start request: envd kills the process when it passes, even
        when the client has gone away (its process context has the request's timeout, not its cancellation)."""
        reaper.watch(self.pid, self._on_exit)
        if deadline is not None:
            self._deadline = self._loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        self.expired = True
        self.signal(signal.SIGKILL)

    def _on_exit(self, wait_status: int) -> None:
        self._popen.returncode = os.waitstatus_to_exitcode(wait_status)  # silences Popen's "still running"
        self._exit = exit_info(wait_status)
        if self._deadline is not None:
            self._deadline.cancel()
        if not self._readers:
            self._finish()
        else:
            self._grace = self._loop.call_later(DRAIN_GRACE_S, self._finish)

    def _finish(self) -> None:
        if self._end is not None or self._exit is None:
            return
        if self._grace is not None:
            self._grace.cancel()
        for fd in list(self._readers):
            self._drain(fd)
            self._close_reader(fd)
        for input_fd in (self._stdin_fd, self._pty_fd):
            if input_fd is not None:
                os.close(input_fd)
        self._stdin_fd = self._pty_fd = None
        self._end = end_event(self._exit)
        if self.on_end is not None:
            self.on_end(self)
        self._broadcast(self._end)
        self._broadcast(None)
        self._subscribers.clear()
        self.ended.set()
        if self._refill and self._spares is not None:
            self._spares.prime_when_idle(self.spec.user)

    # --- output ----------------------------------------------------------------------------------------------
    def _add_reader(self, fd: int, kind: str) -> None:
        _set_nonblocking(fd)
        self._readers[fd] = kind
        self._loop.add_reader(fd, self._on_readable, fd)

    def _close_reader(self, fd: int) -> None:
        kind = self._readers.pop(fd, None)
        if kind is None:
            return
        self._loop.remove_reader(fd)
        if kind != "pty":  # the pty master doubles as the input fd and is closed in _finish
            os.close(fd)

    def _read_once(self, fd: int) -> bytes | None:
        """One chunk, b"" at EOF, None when nothing is ready."""
        try:
            return os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return None
        except OSError as e:
            if e.errno == errno.EIO:  # pty: every slave fd is closed
                return b""
            raise

    def _on_readable(self, fd: int) -> None:
        data = self._read_once(fd)
        if data is None:
            return
        if data:
            self._output(self._readers[fd], data)
            return
        self._close_reader(fd)
        if not self._readers and self._exit is not None:
            self._finish()

    def _drain(self, fd: int) -> None:
        for _ in range(64):  # bounded: a writer that never stops must not wedge the loop
            data = self._read_once(fd)
            if not data:
                return
            self._output(self._readers[fd], data)

    def _output(self, kind: str, data: bytes) -> None:
        if self.on_output is not None:
            self.on_output(kind, data)
        self._broadcast(data_event(kind, data))

    def _broadcast(self, event: ProcessEvent | None) -> None:
        for queue in self._subscribers:
            queue.put_nowait(event)

    # --- API -------------------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._end is None

    @property
    def end(self) -> ProcessEvent | None:
        return self._end

    @property
    def exit(self) -> ExitInfo | None:
        return self._exit

    def subscribe(self) -> asyncio.Queue[ProcessEvent | None]:
        """Live events from now on; the queue receives None after the end event."""
        queue: asyncio.Queue[ProcessEvent | None] = asyncio.Queue()
        if self._end is not None:
            queue.put_nowait(self._end)
            queue.put_nowait(None)
        else:
            self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[ProcessEvent | None]) -> None:
        self._subscribers.discard(queue)

    def info(self) -> ProcessInfo:
        info = ProcessInfo(config=self.spec.config, pid=self.pid)
        if self.tag is not None:
            info.tag = self.tag
        return info

    def signal(self, sig: int) -> None:
        if self._exit is not None:
            return
        try:
            os.killpg(self.pid, sig)  # the whole session: `bash -c` children must not outlive a kill
        except ProcessLookupError:
            pass
        except PermissionError:
            os.kill(self.pid, sig)

    async def write_input(self, kind: str, data: bytes) -> None:
        if kind == "pty":
            if self._pty_fd is None:
                raise ProcessError("process has no pty" if self.spec.pty_size is None else "pty is closed")
            fd = self._pty_fd
        else:
            if self.spec.pty_size is not None:
                raise ProcessError("cannot send stdin to a pty process, send pty input instead")
            if self._stdin_fd is None:
                raise ProcessError("stdin is not enabled or already closed")
            fd = self._stdin_fd
        async with self._input_lock:
            await _write_all(self._loop, fd, data)

    def close_stdin(self) -> None:
        if self.spec.pty_size is not None:
            raise ProcessError("cannot close stdin of a pty process, send Ctrl+D (0x04) instead")
        if self._stdin_fd is not None:
            os.close(self._stdin_fd)
            self._stdin_fd = None

    def resize(self, cols: int, rows: int) -> None:
        if self._pty_fd is None:
            raise ProcessError("process has no pty")
        fcntl.ioctl(self._pty_fd, termios.TIOCSWINSZ, _winsize(cols, rows))


def _set_ready(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


async def _write_all(loop: asyncio.AbstractEventLoop, fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            ready: asyncio.Future[None] = loop.create_future()
            loop.add_writer(fd, _set_ready, ready)
            try:
                await ready
            finally:
                loop.remove_writer(fd)
            continue
        except BrokenPipeError as e:
            raise ProcessError("stdin is closed: the process stopped reading") from e
        view = view[n:]


class OutputJournal:
    """The first lines a process prints, into the journal as `process.output` entries (the sandbox's logs show
    them): at most OUTPUT_ENTRIES entries and OUTPUT_BYTES of text per process, then one `truncated` entry. Bounded
    so that a chatty process cannot push the journal's other entries out before the host pulls them. A chunk is
    split at line ends; a line split across two reads becomes two entries."""

    def __init__(self, journal: Journal, pid: int) -> None:
        self._journal, self._pid = journal, pid
        self._entries, self._bytes, self._done = 0, 0, False

    def __call__(self, stream: str, data: bytes) -> None:
        if self._done:
            return
        for line in data.decode("utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            if self._entries >= OUTPUT_ENTRIES or self._bytes >= OUTPUT_BYTES:
                self._journal.append("process.output", {"pid": self._pid, "truncated": True})
                self._done = True
                return
            text = line[:OUTPUT_BYTES - self._bytes]
            self._journal.append("process.output", {"pid": self._pid, "stream": stream, "text": text})
            self._entries, self._bytes = self._entries + 1, self._bytes + len(text)


class ProcessTable:
    """Every process started through the API, by pid and by tag."""

    def __init__(self, reaper: ChildReaper = REAPER, journal: Journal | None = None,
                 spares: Spares | None = None) -> None:
        self._by_pid: dict[int, ManagedProcess] = {}
        self.spares = spares
        self._reaper = reaper
        self._journal = journal or Journal()
        self._forgetting: set[asyncio.Task[None]] = set()  # the event loop holds tasks only weakly

    def start(self, spec: SpawnSpec, deadline: float | None) -> ManagedProcess:
        loop = asyncio.get_running_loop()
        self._reaper.install(loop)
        if spec.tag is not None and any(p.tag == spec.tag and p.running for p in self._by_pid.values()):
            raise InvalidProcessRequest(f"a running process already has tag '{spec.tag}'")
        proc = ManagedProcess(spec, loop, self.spares)
        self._by_pid[proc.pid] = proc
        self._journal.append("process.start", {
            "pid": proc.pid, "cmd": spec.cmd, "args": list(spec.args), "cwd": spec.cwd, "user": spec.user.name,
            "tag": spec.tag, "pty": spec.pty_size is not None,
        })
        proc.on_end = self._journal_exit
        proc.on_output = OutputJournal(self._journal, proc.pid)
        proc.start(self._reaper, deadline)
        task = loop.create_task(self._forget_later(proc))
        self._forgetting.add(task)
        task.add_done_callback(self._forgetting.discard)
        return proc

    def _journal_exit(self, proc: ManagedProcess) -> None:
        if proc.exit is not None:
            self._journal.append("process.exit", {
                "pid": proc.pid, "exitCode": proc.exit.exit_code, "status": proc.exit.status,
            })

    async def _forget_later(self, proc: ManagedProcess) -> None:
        await proc.ended.wait()
        await asyncio.sleep(RETAIN_EXITED_S)
        if self._by_pid.get(proc.pid) is proc:
            del self._by_pid[proc.pid]

    def get(self, pid: int | None = None, tag: str | None = None) -> ManagedProcess:
        if pid is not None:
            proc = self._by_pid.get(pid)
            if proc is not None:
                return proc
            raise ProcessNotFound(f"process with pid {pid} not found")
        if tag is not None:
            # Prefer a running process when a tag was reused after an exit.
            matches = [p for p in self._by_pid.values() if p.tag == tag]
            matches.sort(key=lambda p: p.running, reverse=True)
            if matches:
                return matches[0]
            raise ProcessNotFound(f"process with tag '{tag}' not found")
        raise InvalidProcessRequest("process selector is empty")

    def running(self) -> Iterable[ManagedProcess]:
        return [p for p in self._by_pid.values() if p.running]

    def kill_all(self) -> None:
        for proc in self.running():
            proc.signal(signal.SIGKILL)
        if self.spares is not None:
            self.spares.close()
