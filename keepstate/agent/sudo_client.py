#!/usr/bin/python3 -IS
"""`sudo` for KeepState sandboxes (installed as /usr/local/bin/sudo by the template).

gVisor always reports no_new_privs, so a setuid `sudo` can never gain root here. This client instead hands its argv,
environment, working directory and stdio file descriptors (SCM_RIGHTS) to the agent, which runs as root, checks who
is asking (SCM_CREDENTIALS, checked by the kernel) and runs the command; signals are relayed, and the command's
exit status becomes ours.

Only the standard library, no `site` (-S), and only modules that import no others (`_socket`, `_signal`, not
`socket`, `signal` or `json`, which pull in enum and re): under gVisor those imports alone cost ~35 ms, more than
the rest of a `sudo true`.
"""

from __future__ import annotations

import _signal
import _socket
import os
import struct
import sys

TYPE_CHECKING = False  # typing is not imported at run time: it costs this short-lived program's start
if TYPE_CHECKING:
    from typing import Any

SOCKET_ENV = "KEEPSTATE_SUDO_SOCKET"
DEFAULT_SOCKET = "/run/keepstate/sudo.sock"
VERSION = "Sudo version 1.9.13p3 (KeepState agent relay)"
USAGE = """usage: sudo -h | -K | -k | -V
usage: sudo -v [-knS] [-u user]
usage: sudo -l [-knS] [-U user] [-u user] [command [arg ...]]
usage: sudo [-EHknS] [-D directory] [-u user] [VAR=value] [-i | -s] [command [arg ...]]
"""
PROTOCOL = "keepstate-sudo/1"
RELAYED_SIGNALS = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP, _signal.SIGQUIT, _signal.SIGUSR1,
                   _signal.SIGUSR2, _signal.SIGWINCH, _signal.SIGCONT)

# Options that take a value: short letter -> long name.
_WITH_VALUE = {"u": "user", "g": "group", "p": "prompt", "C": "close-from", "D": "chdir", "U": "other-user",
               "r": "role", "t": "type", "T": "command-timeout", "R": "chroot", "h": "host"}
_LONG_FLAGS = {"non-interactive": "n", "preserve-env": "E", "set-home": "H", "login": "i", "shell": "s",
               "list": "l", "validate": "v", "reset-timestamp": "k", "remove-timestamp": "K", "version": "V",
               "help": "help", "stdin": "S", "askpass": "A", "background": "b", "preserve-groups": "P", "edit": "e"}
_LONG_VALUES = {v: k for k, v in _WITH_VALUE.items()}


class UsageError(Exception):
    pass


def parse_argv(argv: list[str]) -> dict[str, Any]:
    """sudo's command line → what to ask the agent for (or a local action: help, version, list, no-op)."""
    flags: set[str] = set()
    values: dict[str, str] = {}
    preserve: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg[2:].partition("=")
            if name == "preserve-env" and eq:
                preserve += [v for v in value.split(",") if v]
            elif name in _LONG_FLAGS:
                flags.add(_LONG_FLAGS[name])
            elif name in _LONG_VALUES:
                if not eq:
                    i += 1
                    if i >= len(argv):
                        raise UsageError(f"option '--{name}' requires an argument")
                    value = argv[i]
                values[_LONG_VALUES[name]] = value
            else:
                raise UsageError(f"unrecognized option '--{name}'")
            i += 1
            continue
        if not arg.startswith("-") or arg == "-":
            break
        letters = arg[1:]
        j = 0
        while j < len(letters):
            letter = letters[j]
            if letter in _WITH_VALUE:
                value = letters[j + 1:]
                if not value:
                    if letter == "h" and i + 1 >= len(argv):
                        flags.add("help")  # a bare -h is help, -h HOST is the host option
                        break
                    i += 1
                    if i >= len(argv):
                        raise UsageError(f"option requires an argument -- '{letter}'")
                    value = argv[i]
                values[letter] = value
                break
            if letter not in "nEHislvkKVSAbPe":
                raise UsageError(f"invalid option -- '{letter}'")
            flags.add(letter)
            j += 1
        i += 1
    rest = argv[i:]
    assignments: dict[str, str] = {}
    while rest and "=" in rest[0] and not rest[0].startswith("=") and rest[0].split("=", 1)[0].isidentifier():
        name, _, value = rest.pop(0).partition("=")
        assignments[name] = value
    if "i" in flags and "s" in flags:
        raise UsageError("you may not specify both the -i and -s options")
    for unsupported, what in (("g", "-g (run as group)"), ("R", "-R (chroot)"), ("e", "-e (sudoedit)"),
                              ("b", "-b (background)")):
        if unsupported in flags or unsupported in values:
            raise UsageError(f"{what} is not supported in this sandbox")
    if "help" in flags:
        return {"action": "help"}
    if "V" in flags:
        return {"action": "version"}
    if "l" in flags:
        return {"action": "list", "command": rest}
    if not rest and "i" not in flags and "s" not in flags:
        if flags & set("vkK"):
            return {"action": "noop"}
        raise UsageError("a command is required")
    return {
        "action": "run",
        "command": rest,
        "user": values.get("u", "root"),
        "login": "i" in flags,
        "shell": "s" in flags,
        "preserve_env": "E" in flags,
        "preserve_list": preserve,
        "set_home": "H" in flags,
        "chdir": values.get("D"),
        "assignments": assignments,
    }


def encode_request(request: dict[str, Any], env: dict[str, str], cwd: str, umask: int) -> bytes:
    """NUL-separated tokens (argv and environ cannot contain NUL): `name value` pairs and `name count items...`
    lists; the agent's `sudo_server.decode_request` reads them back."""
    tokens = [PROTOCOL, "user", request["user"], "cwd", cwd, "umask", str(umask),
              "flags", "".join(f for f, key in (("i", "login"), ("s", "shell"), ("E", "preserve_env"),
                                                 ("H", "set_home")) if request.get(key))]
    if request.get("chdir"):
        tokens += ["chdir", request["chdir"]]
    for name, items in (("command", request["command"]), ("preserve", request["preserve_list"]),
                        ("assign", [f"{k}={v}" for k, v in request["assignments"].items()]),
                        ("env", [f"{k}={v}" for k, v in env.items()])):
        tokens += [name, str(len(items)), *items]
    return "\0".join(tokens).encode("utf-8", "surrogateescape")


def _send_request(sock: _socket.socket, payload: bytes) -> None:
    frame = struct.pack(">I", len(payload)) + payload
    # Our credentials ride along explicitly: the kernel checks them, and the agent trusts nothing else.
    creds = struct.pack("3i", os.getpid(), os.getuid(), os.getgid())
    sent = sock.sendmsg([frame], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack("3i", 0, 1, 2)),
                                  (_socket.SOL_SOCKET, _socket.SCM_CREDENTIALS, creds)])
    if sent < len(frame):
        sock.sendall(frame[sent:])


def _die_like(sig: int) -> int:
    sys.stdout.flush()
    _signal.signal(sig, _signal.SIG_DFL)
    os.kill(os.getpid(), sig)  # end the way the command ended, like sudo
    return 128 + sig


def run(request: dict[str, Any]) -> int:
    path = os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as e:
        sys.stderr.write(f"sudo: cannot reach the sandbox agent at {path}: {e.strerror}\n")
        return 1
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = "/"
    umask = os.umask(0o022)
    os.umask(umask)
    _send_request(sock, encode_request(request, dict(os.environ), cwd, umask))

    def relay(signum: int, frame: object) -> None:
        try:
            sock.sendall(f"signal {signum}\n".encode())
        except OSError:
            pass

    for sig in RELAYED_SIGNALS:
        _signal.signal(sig, relay)
    # One reply line: "exit N", "signal N" or "error N message".
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            sys.stderr.write("sudo: the sandbox agent closed the connection\n")
            return 1
        reply += chunk
    kind, _, rest = reply.decode("utf-8", "replace").rstrip("\n").partition(" ")
    number, _, message = rest.partition(" ")
    if kind == "error":
        sys.stderr.write(f"sudo: {message}\n")
        return int(number)
    if kind == "signal":
        return _die_like(int(number))
    return int(number)


def main(argv: list[str]) -> int:
    try:
        request = parse_argv(argv)
    except UsageError as e:
        sys.stderr.write(f"sudo: {e}\n{USAGE}")
        return 1
    action = request["action"]
    if action == "help":
        sys.stdout.write(USAGE)
        return 0
    if action == "version":
        print(VERSION)
        return 0
    if action == "noop":
        return 0
    if action == "list":
        if request["command"]:
            print(" ".join(request["command"]))
            return 0
        print("User may run the following commands on sandbox:\n    (ALL : ALL) NOPASSWD: ALL")
        return 0
    return run(request)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
