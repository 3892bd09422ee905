"""Starting a child as another user with one exec: `posix_spawn` from a thread that holds that user's identity.

The agent runs as root and starts commands as the sandbox's user. CPython's subprocess cannot change identity
after a vfork (it falls back to a fork, 25-35 ms of the agent's address space copied under gVisor), so the usual
way was `setpriv --reuid --regid --groups -- PROGRAM` after a vfork: two execs, ~15-20 ms more than one
(docs/design/command-path.md).

Linux keeps credentials, the working directory and the umask per thread (glibc's setuid() makes every thread of a
process change together; the raw system calls change the calling thread only). A thread of the agent that has
`unshare(CLONE_FS)` and made the raw `setgroups`, `setresgid`, `setresuid` calls is that user for good: real,
effective and saved ids, no capabilities left (all ids non-zero clears them), its own directory and umask 022. A
child it starts with `posix_spawn` (a vfork: nothing copied) inherits exactly that, and is still the agent's child
(its parent is the process, not the thread): what `setpriv` would have started, one exec sooner. One such thread is
kept per identity (uid, gid, groups).

`spawn()` returns None wherever this cannot be done (not root, another architecture, a refused call, a directory
the user cannot enter, an exec that fails), and the caller takes the setpriv path, whose behaviour is unchanged.
Children get fds 0-2 and those passed only: the agent's fds are close-on-exec (Python's default), and any
inheritable one found is closed for the child, as Popen's close_fds does.
"""

from __future__ import annotations

import ctypes
import os
import platform
import queue
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, NamedTuple, Protocol

from keepstate.agent.users import Ids


class _Numbers(NamedTuple):
    """The system calls made raw, by number (glibc's wrappers act on every thread, or refuse glibc's signals)."""

    setgroups: int
    setresgid: int
    setresuid: int
    unshare: int
    rt_sigaction: int


_SYSCALLS = {"x86_64": _Numbers(116, 119, 117, 272, 13), "aarch64": _Numbers(159, 149, 147, 97, 134)}
CLONE_FS = 0x200
UMASK = 0o022
# Set to their defaults in the child: SIGPIPE and SIGXFSZ, which Python ignores (Popen's restore_signals). glibc's
# internal signals (32 up to SIGRTMIN) are inherited as an exec from Popen leaves them: ignored where the agent
# ignores them (it may have inherited that), else at their defaults; glibc's posix_spawn would leave them ignored
# in the child unless they are in the set to default, and its sigaddset refuses them, so os.posix_spawn cannot
# name them: posix_spawn is called through ctypes with the set's bits written directly (which also lets other
# threads run while it waits for the child's exec), and the agent's own disposition is read with the raw
# rt_sigaction (glibc's sigaction refuses those signals too).
ALWAYS_DEFAULT = (signal.SIGPIPE, signal.SIGXFSZ)
INTERNAL_SIGNALS = tuple(range(32, signal.SIGRTMIN))
SIG_IGN = 1
SETSIGDEF, SETSIGMASK, SETSID = 0x04, 0x08, 0x80  # glibc's POSIX_SPAWN_* flags
_WORD = 8 * ctypes.sizeof(ctypes.c_ulong)
_SigSet = ctypes.c_ulong * (1024 // _WORD)  # glibc's sigset_t


class Started(Protocol):
    """What the agent uses of a started child: subprocess.Popen's, or a `Child`'s."""

    pid: int
    stdin: IO[bytes] | None
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...

    def communicate(self, input: bytes | None = None, timeout: float | None = None) -> tuple[bytes, bytes]: ...


class Child:
    """A child started by `spawn`: the part of Popen's interface the agent uses (pipes unbuffered, bufsize=0)."""

    def __init__(self, pid: int, args: Sequence[str], stdin: IO[bytes] | None, stdout: IO[bytes] | None,
                 stderr: IO[bytes] | None) -> None:
        self.pid, self.args = pid, list(args)
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = 0  # reaped elsewhere: as Popen does
            else:
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, input: bytes | None = None, timeout: float | None = None) -> tuple[bytes, bytes]:
        """Popen's: send `input`, read stdout and stderr to their ends, wait for the exit."""
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
            self.stdin.close()
            self.stdin = None
        end = None if timeout is None else time.monotonic() + timeout
        streams = [f for f in (self.stdout, self.stderr) if f is not None]
        got: dict[int, list[bytes]] = {f.fileno(): [] for f in streams}
        with selectors.DefaultSelector() as selector:
            for f in streams:
                selector.register(f.fileno(), selectors.EVENT_READ)
            while selector.get_map():
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                for key, _ in selector.select(left):
                    chunk = os.read(key.fd, 65536)
                    if chunk:
                        got[key.fd].append(chunk)
                    else:
                        selector.unregister(key.fd)
        out, err = (b"".join(got[f.fileno()]) if f is not None else b"" for f in (self.stdout, self.stderr))
        for f in streams:
            f.close()
        self.wait(None if end is None else max(end - time.monotonic(), 0.0))
        return out, err

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclass
class _Job:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    dups: list[tuple[int, int]]  # (fd, number in the child)
    null_stdin: bool  # stdin opened on /dev/null in the child
    closes: list[int]
    done: threading.Event = field(default_factory=threading.Event)
    pid: int | None = None


class _AsUser:
    """One thread that has become `identity` and starts children on request."""

    def __init__(self, identity: Ids) -> None:
        self.identity = identity
        self.ok = False
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), name=f"spawn-as-{identity[0]}", daemon=True).start()
        ready.wait()

    def _become(self) -> None:
        numbers = _SYSCALLS.get(platform.machine())
        if numbers is None or os.geteuid() != 0:
            raise OSError("no per-thread identity here")
        uid, gid, groups = self.identity
        libc = _libc()
        array = (ctypes.c_uint * max(len(groups), 1))(*groups)
        calls: list[tuple[int, tuple[object, ...]]] = [
            (numbers.unshare, (CLONE_FS,)), (numbers.setgroups, (len(groups), array)),
            (numbers.setresgid, (gid, gid, gid)), (numbers.setresuid, (uid, uid, uid))]
        for number, args in calls:
            if libc.syscall(number, *args) != 0:
                raise OSError(ctypes.get_errno(), f"system call {number}")
        os.umask(UMASK)
        if (os.getresuid(), os.getresgid(), sorted(os.getgroups())) != ((uid,) * 3, (gid,) * 3, sorted(groups)):
            raise OSError("the thread's identity did not change")

    def _run(self, ready: threading.Event) -> None:
        try:
            self._become()
        except OSError:
            ready.set()  # self.ok stays False; the thread ends (it never started a child)
            return
        self.ok = True
        ready.set()
        while True:
            job = self._jobs.get()
            try:
                os.chdir(job.cwd)  # as the user, in this thread's own directory
                job.pid = _posix_spawn(job)
            except (OSError, ValueError):
                job.pid = None
            finally:
                job.done.set()

    def spawn(self, job: _Job) -> int | None:
        self._jobs.put(job)
        job.done.wait()
        return job.pid


def _sigset(signals: Sequence[int]) -> ctypes.Array[ctypes.c_ulong]:
    bits = _SigSet()
    for sig in signals:
        bits[(sig - 1) // _WORD] |= 1 << ((sig - 1) % _WORD)
    return bits


def _ignored(sig: int) -> bool:
    """Whether the agent ignores `sig` (the raw rt_sigaction: glibc's refuses its internal signals)."""
    old = (ctypes.c_ulong * 8)()  # the kernel's struct sigaction, its handler first
    if _libc().syscall(_SYSCALLS[platform.machine()].rt_sigaction, sig, None, old, 8) != 0:
        raise OSError(ctypes.get_errno(), f"rt_sigaction({sig})")
    return bool(old[0] == SIG_IGN)


def _check(err: int) -> None:
    if err:
        raise OSError(err, os.strerror(err))


def _cstrings(items: Sequence[str]) -> ctypes.Array[ctypes.c_char_p]:
    encoded = [os.fsencode(item) for item in items]
    if any(b"\0" in item for item in encoded):
        raise ValueError("embedded null byte")
    return (ctypes.c_char_p * (len(encoded) + 1))(*encoded, None)


def _posix_spawn(job: _Job) -> int:
    """glibc's posix_spawn of job.argv[0] in a new session, signal mask empty, ALWAYS_DEFAULT at their defaults and
    glibc's internal signals as an exec would leave them."""
    libc = _libc()
    file_actions, attr = ctypes.create_string_buffer(512), ctypes.create_string_buffer(1024)  # 80 and 336 bytes
    args, envp = _cstrings(job.argv), _cstrings([f"{k}={v}" for k, v in job.env.items()])
    _check(libc.posix_spawn_file_actions_init(file_actions))
    try:
        if job.null_stdin:
            _check(libc.posix_spawn_file_actions_addopen(file_actions, 0, b"/dev/null", os.O_RDONLY, 0))
        for fd, number in job.dups:
            _check(libc.posix_spawn_file_actions_adddup2(file_actions, fd, number))
        for fd in job.closes:
            _check(libc.posix_spawn_file_actions_addclose(file_actions, fd))
        _check(libc.posix_spawnattr_init(attr))
        try:
            _check(libc.posix_spawnattr_setflags(attr, SETSIGDEF | SETSIGMASK | SETSID))
            defaults = (*ALWAYS_DEFAULT, *(sig for sig in INTERNAL_SIGNALS if not _ignored(sig)))
            _check(libc.posix_spawnattr_setsigdefault(attr, _sigset(defaults)))
            _check(libc.posix_spawnattr_setsigmask(attr, _sigset(())))
            pid = ctypes.c_int()
            _check(libc.posix_spawn(ctypes.byref(pid), args[0], file_actions, attr, args, envp))
            return pid.value
        finally:
            libc.posix_spawnattr_destroy(attr)
    finally:
        libc.posix_spawn_file_actions_destroy(file_actions)


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.posix_spawnattr_setflags.argtypes = [ctypes.c_void_p, ctypes.c_short]
        _LIBC = libc
    return _LIBC


_threads: dict[Ids, _AsUser] = {}
_lock = threading.Lock()


def _as_user(identity: Ids) -> _AsUser:
    with _lock:
        thread = _threads.get(identity)
        if thread is None:
            thread = _threads[identity] = _AsUser(identity)
        return thread


def _inheritable(keep: set[int]) -> list[int]:
    """The agent's fds that a child would inherit and should not (Popen's close_fds)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                if os.get_inheritable(fd):
                    found.append(fd)
            except OSError:
                pass  # the listing's own fd, or one closed meanwhile
    return found


def spawn(identity: Ids, argv: list[str], *, env: dict[str, str], cwd: str, stdin: bool,
          pass_fd: tuple[int, int] | None = None) -> Child | None:
    """Start `argv[0]` (a path) as `identity` in `cwd`, in a new session, umask 022, SIGPIPE and SIGXFSZ at their
    defaults, stdout and stderr pipes to the agent, stdin a pipe (`stdin`) or /dev/null; `pass_fd` (fd, number):
    an fd of the agent's given to the child as `number`. None if it cannot be done this way (the caller takes the
    setpriv path)."""
    thread = _as_user(identity)
    if not thread.ok:
        return None
    mine: list[int] = []  # the agent's ends
    theirs: list[int] = []  # the child's ends, closed here once it has them
    try:
        dups: list[tuple[int, int]] = []
        if stdin:
            read, write = os.pipe()
            mine.append(write)
            theirs.append(read)
            dups.append((read, 0))
        for number in (1, 2):
            read, write = os.pipe()
            mine.append(read)
            theirs.append(write)
            dups.append((write, number))
        if pass_fd is not None:
            dups.append(pass_fd)
        closes = _inheritable({*mine, *theirs, *(fd for fd, _ in dups)})
        pid = thread.spawn(_Job(argv, env, cwd, dups, not stdin, closes))
    except OSError:
        pid = None
    for fd in theirs:
        os.close(fd)
    if pid is None:
        for fd in mine:
            os.close(fd)
        return None
    files = [open(fd, "rb" if i or not stdin else "wb", buffering=0) for i, fd in enumerate(mine)]  # noqa: SIM115
    stdin_file = files.pop(0) if stdin else None
    return Child(pid, argv, stdin_file, files[0], files[1])
