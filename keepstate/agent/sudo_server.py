"""The privileged side of `sudo` in the sandbox: a Unix socket where the agent (root) runs commands for allowed users.

gVisor reports no_new_privs to every process, so setuid binaries never elevate; `sudo_client.py` (installed as
/usr/local/bin/sudo) sends its request here instead. Wire format, client → agent: one frame `u32 length (big-endian)
| NUL-separated tokens` (see `decode_request`), with the client's fds 0, 1, 2 attached (SCM_RIGHTS); then
`signal N` lines to relay signals. Agent → client, one line: `error 1 <message>`, or once the command ends
`exit <code>` / `signal <N>`. (Not JSON: importing json costs the client ~25 ms under gVisor.)

Who may: root, members of group `sudo`, and the template's default user (whose /etc/sudoers.d entry is NOPASSWD);
identified by the kernel-checked SCM_CREDENTIALS of the request (SO_PASSCRED), never by anything else the client
says. Not SO_PEERCRED: gVisor 20240729 reports the listener's credentials (root) for accepted sockets.
Pure parts (`authorize`, `build_env`, `build_argv`) take plain values so they are tested without sockets.
"""

from __future__ import annotations

import array
import asyncio
import grp
import logging
import os
import pwd
import shutil
import signal
import socket
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from keepstate.agent.journal import Journal
from keepstate.agent.reaper import REAPER, ChildReaper

log = logging.getLogger("keepstate.agent.sudo")

SOCKET_ENV = "KEEPSTATE_SUDO_SOCKET"
DEFAULT_SOCKET = "/run/keepstate/sudo.sock"
SECURE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SUDO_GROUP = "sudo"
MAX_REQUEST = 4 << 20
# What sudo's env_reset keeps from the caller (Debian defaults), besides the LC_* family.
ENV_KEEP = ("TERM", "COLORTERM", "COLORS", "DISPLAY", "HOSTNAME", "LANG", "LANGUAGE", "LINGUAS", "LS_COLORS",
            "PS1", "PS2", "TZ", "XAUTHORITY", SOCKET_ENV)


PROTOCOL = "keepstate-sudo/1"


class SudoRefused(Exception):
    """A request the agent will not run; the message is shown to the user as `sudo: <message>`."""


@dataclass(frozen=True)
class Target:
    name: str
    uid: int
    gid: int
    home: str
    shell: str


@dataclass(frozen=True)
class Caller:
    name: str
    uid: int
    gid: int


def decode_request(payload: bytes) -> dict[str, Any]:
    """The client's tokens → the request dict that `build_env`/`build_argv` read. Raises ValueError if malformed."""
    tokens = payload.decode("utf-8", "surrogateescape").split("\0")
    if not tokens or tokens[0] != PROTOCOL:
        raise ValueError(f"expected protocol {PROTOCOL}")
    request: dict[str, Any] = {"command": [], "preserve_list": [], "assignments": {}, "env": {}}
    i = 1

    def take() -> str:
        nonlocal i
        if i >= len(tokens):
            raise ValueError("truncated request")
        i += 1
        return tokens[i - 1]

    def pairs(items: list[str]) -> dict[str, str]:
        return dict(item.partition("=")[::2] for item in items)

    while i < len(tokens):
        name = take()
        if name in ("user", "cwd", "chdir"):
            request[name] = take()
        elif name == "umask":
            request["umask"] = int(take())
        elif name == "flags":
            flags = take()
            request.update({"login": "i" in flags, "shell": "s" in flags, "preserve_env": "E" in flags,
                            "set_home": "H" in flags})
        elif name in ("command", "preserve", "assign", "env"):
            items = [take() for _ in range(int(take()))]
            if name == "command":
                request["command"] = items
            elif name == "preserve":
                request["preserve_list"] = items
            else:
                request["assignments" if name == "assign" else "env"] = pairs(items)
        else:
            raise ValueError(f"unknown field '{name}'")
    return request


def authorize(caller: Caller, caller_groups: set[str], default_user: str) -> bool:
    return caller.uid == 0 or caller.name == default_user or SUDO_GROUP in caller_groups


def escape_for_shell(args: list[str]) -> str:
    """sudo's -i/-s rendering of a command: every character but alphanumerics, `_`, `-` and `$` backslashed."""
    return " ".join("".join(c if c.isalnum() or c in "_-$" else "\\" + c for c in arg) for arg in args)


def build_env(request: dict[str, Any], caller: Caller, target: Target) -> dict[str, str]:
    client_env: dict[str, str] = {str(k): str(v) for k, v in (request.get("env") or {}).items()}
    if request.get("preserve_env"):
        env = dict(client_env)
    else:
        env = {k: v for k, v in client_env.items() if k in ENV_KEEP or k.startswith("LC_")}
        for name in request.get("preserve_list") or []:
            if name in client_env:
                env[name] = client_env[name]
    env["PATH"] = SECURE_PATH
    if not request.get("preserve_env") or request.get("set_home") or request.get("login"):
        env["HOME"] = target.home
    env.update({"SHELL": target.shell, "USER": target.name, "LOGNAME": target.name, "MAIL": f"/var/mail/{target.name}",
                "SUDO_USER": caller.name, "SUDO_UID": str(caller.uid), "SUDO_GID": str(caller.gid)})
    env["SUDO_COMMAND"] = " ".join(request.get("command") or [target.shell])
    env.update({str(k): str(v) for k, v in (request.get("assignments") or {}).items()})
    return env


def build_argv(request: dict[str, Any], target: Target, env: dict[str, str],
               which: Callable[[str, str], str | None]) -> list[str]:
    command: list[str] = list(request.get("command") or [])
    if request.get("login") or request.get("shell"):
        shell = target.shell
        if request.get("shell") and not request.get("login"):
            shell = (request.get("env") or {}).get("SHELL") or target.shell
        login = ["-l"] if request.get("login") else []
        return [shell, *login, "-c", escape_for_shell(command)] if command else [shell, *login]
    if not command:
        raise SudoRefused("a command is required")
    program = command[0]
    if "/" not in program:
        found = which(program, env["PATH"])
        if found is None:
            raise SudoRefused(f"{program}: command not found")
        program = found
    return [program, *command[1:]]


def lookup_target(spec: str) -> Target:
    try:
        entry = pwd.getpwuid(int(spec[1:])) if spec.startswith("#") else pwd.getpwnam(spec)
    except (KeyError, ValueError):
        raise SudoRefused(f"unknown user {spec}") from None
    return Target(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir or "/", entry.pw_shell or "/bin/sh")


def lookup_caller(uid: int, gid: int) -> tuple[Caller, set[str]]:
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return Caller(str(uid), uid, gid), set()
    groups: set[str] = set()
    for g in os.getgrouplist(entry.pw_name, entry.pw_gid):
        try:
            groups.add(grp.getgrgid(g).gr_name)
        except KeyError:
            continue
    return Caller(entry.pw_name, uid, gid), groups


def _which(program: str, path: str) -> str | None:
    return shutil.which(program, path=path)


class _Session:
    """One sudo invocation: read the request and fds, run the command, relay signals, report the end."""

    def __init__(self, server: SudoServer, conn: socket.socket) -> None:
        self._server = server
        self._conn = conn
        self._loop = server.loop
        self._buffer = bytearray()
        self._fds: list[int] = []
        self._creds: tuple[int, int, int] | None = None  # pid, uid, gid as attested by the kernel
        self._pid: int | None = None
        self._done = False

    def begin(self) -> None:
        self._conn.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._conn.setblocking(False)
        self._loop.add_reader(self._conn.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        try:
            data, ancdata, _flags, _addr = self._conn.recvmsg(
                65536, socket.CMSG_SPACE(16 * 4) + socket.CMSG_SPACE(struct.calcsize("3i")))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, ancdata = b"", []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                self._fds += list(fds)
            elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and self._creds is None:
                self._creds = struct.unpack("3i", payload[: struct.calcsize("3i")])
        if not data:
            self._on_client_gone()
            return
        self._buffer += data
        if self._pid is None:
            self._maybe_start()
        else:
            self._relay_signals()

    def _maybe_start(self) -> None:
        if len(self._buffer) < 4:
            return
        (length,) = struct.unpack(">I", self._buffer[:4])
        if length > MAX_REQUEST:
            self._fail("request too large")
            return
        if len(self._buffer) < 4 + length:
            return
        body = bytes(self._buffer[4 : 4 + length])
        del self._buffer[: 4 + length]
        try:
            self._start(decode_request(body))
        except SudoRefused as e:
            self._fail(str(e))
        except (ValueError, TypeError) as e:
            self._fail(f"bad request: {e}")
        except OSError as e:
            self._fail(f"unable to execute: {e.strerror or e}")
        finally:
            self._close_fds()

    def _start(self, request: dict[str, Any]) -> None:
        if self._creds is None:
            raise SudoRefused("could not verify who is asking (no SCM_CREDENTIALS)")
        _peer_pid, uid, gid = self._creds
        caller, groups = lookup_caller(uid, gid)
        if not authorize(caller, groups, self._server.default_user()):
            log.warning("sudo refused for uid %d (%s)", uid, caller.name)
            raise SudoRefused(f"{caller.name} is not in the sudoers file.")
        if len(self._fds) < 3:
            raise SudoRefused("the request carried no stdin/stdout/stderr")
        target = lookup_target(str(request.get("user") or "root"))
        env = build_env(request, caller, target)
        argv = build_argv(request, target, env, _which)
        cwd = target.home if request.get("login") else str(request.get("chdir") or request.get("cwd") or "/")
        if not os.path.isdir(cwd):
            raise SudoRefused(f"unable to change directory to {cwd}")
        from keepstate.agent.process import pipe_spawn_argv  # lazily: it pulls in protobuf
        from keepstate.agent.users import User

        command = argv  # what the journal records; argv may gain a setpriv prefix
        argv, identity = pipe_spawn_argv(argv, User(target.name, target.uid, target.gid, target.home, target.shell),
                                         env)
        umask = request.get("umask")
        proc = subprocess.Popen(  # noqa: S603 - running the allowed caller's command is the point
            argv, stdin=self._fds[0], stdout=self._fds[1], stderr=self._fds[2], cwd=cwd, env=env,
            umask=(umask | 0o022) if isinstance(umask, int) else 0o022, start_new_session=True, close_fds=True,
            **identity,
        )
        self._pid = proc.pid
        self._server.journal.append("process.start", {
            "pid": proc.pid, "cmd": command[0], "args": command[1:], "cwd": cwd, "user": target.name, "tag": "sudo",
            "pty": False,
        })

        def on_exit(status: int) -> None:
            from keepstate.agent.process_events import exit_info  # lazily: it pulls in protobuf

            proc.returncode = os.waitstatus_to_exitcode(status)  # keeps Popen from reaping it again
            info = exit_info(status)
            self._server.journal.append("process.exit", {"pid": proc.pid, "exitCode": info.exit_code,
                                                         "status": info.status})
            if os.WIFSIGNALED(status):
                self._finish(f"signal {os.WTERMSIG(status)}")
            else:
                self._finish(f"exit {os.WEXITSTATUS(status)}")

        self._server.reaper.watch(proc.pid, on_exit)
        self._relay_signals()

    def _relay_signals(self) -> None:
        while b"\n" in self._buffer:
            line, _, rest = bytes(self._buffer).partition(b"\n")
            self._buffer = bytearray(rest)
            kind, _, number = line.decode("ascii", "replace").partition(" ")
            try:
                sig = int(number) if kind == "signal" else 0
            except ValueError:
                continue
            if self._pid is not None and sig in {s.value for s in signal.Signals}:
                try:
                    os.killpg(self._pid, sig)
                except ProcessLookupError:
                    pass

    def _on_client_gone(self) -> None:
        # The sudo process died (killed with its command's process group, timed out...): its command must not
        # outlive it as an orphan root process.
        if self._pid is not None and not self._done:
            try:
                os.killpg(self._pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._close()

    def _fail(self, message: str) -> None:
        self._finish("error 1 " + message.replace("\n", " "))

    def _finish(self, reply: str) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._conn.setblocking(True)
            self._conn.sendall(reply.encode("utf-8", "replace") + b"\n")
        except OSError:
            pass
        self._close()

    def _close_fds(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []

    def _close(self) -> None:
        self._done = True
        self._close_fds()
        try:
            self._loop.remove_reader(self._conn.fileno())
        except (ValueError, OSError):
            pass
        self._conn.close()
        self._server.sessions.discard(self)


class SudoServer:
    def __init__(self, path: str, default_user: Callable[[], str], journal: Journal,
                 reaper: ChildReaper = REAPER) -> None:
        self.path = path
        self.default_user = default_user
        self.journal = journal
        self.reaper = reaper
        self.sessions: set[_Session] = set()
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "SudoServer.start() first"
        return self._loop

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
        try:
            os.unlink(self.path)  # a socket file left by an agent that did not stop cleanly
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # accepted sockets attest their sender
        sock.bind(self.path)
        os.chmod(self.path, 0o666)  # anyone may ask; SCM_CREDENTIALS decides
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock
        loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        assert self._sock is not None
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        session = _Session(self, conn)
        self.sessions.add(session)
        session.begin()

    def close(self) -> None:
        if self._sock is not None:
            self.loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            try:
                os.unlink(self.path)
            except OSError:
                pass
        for session in list(self.sessions):
            session._on_client_gone()  # noqa: SLF001 - the agent is stopping: so do the commands it ran


def socket_path() -> str:
    return os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
