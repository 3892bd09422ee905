"""sudo through the agent's privileged relay: argv parsing and env rules, then real `sudo` runs as the user."""

from __future__ import annotations

import importlib.util
import re
import uuid

import pytest
from e2b import CommandExitException

from tests.agent.harness import REMOTE, REPO_ROOT, eventually

CLIENT = REPO_ROOT / "keepstate" / "agent" / "sudo_client.py"
SANDBOX_CLIENT = "/opt/keepstate/lib/keepstate/agent/sudo_client.py"  # the agent code's bind mount


def _client_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("sudo_client", CLIENT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_argv() -> None:
    client = _client_module()
    parse = client.parse_argv
    run = parse(["-n", "id", "-un"])
    assert (run["action"], run["command"], run["user"]) == ("run", ["id", "-un"], "root")
    run = parse(["-nEH", "-uuser", "--", "ls", "-la"])
    assert (run["preserve_env"], run["set_home"], run["user"], run["command"]) == (True, True, "user", ["ls", "-la"])
    run = parse(["--user=nobody", "--login", "FOO=1", "BAR=x=y", "env"])
    assert (run["user"], run["login"], run["assignments"], run["command"]) == (
        "nobody", True, {"FOO": "1", "BAR": "x=y"}, ["env"])
    assert parse(["-u", "nobody", "-s"])["shell"] is True
    assert parse(["--preserve-env=A,B", "x"])["preserve_list"] == ["A", "B"]
    assert parse(["sh", "-c", "-n"])["command"] == ["sh", "-c", "-n"]  # options end at the command
    assert parse(["-l"])["action"] == "list"
    assert parse(["-v"])["action"] == parse(["-k"])["action"] == "noop"
    assert parse(["-h"])["action"] == "help"
    for bad in ([], ["-Z", "x"], ["-u"], ["-i", "-s", "x"], ["-g", "adm", "id"], ["--bogus"]):
        with pytest.raises(client.UsageError):
            parse(bad)


def test_request_encoding_roundtrip() -> None:
    server = pytest.importorskip("keepstate.agent.sudo_server")
    request = _client_module().parse_argv(["-E", "-u", "nobody", "--preserve-env=A", "X=1=2", "printf", "%s\n", "a b",
                                           "caf\u00e9"])
    env = {"PATH": "/bin", "ODD": "x=y", "EMPTY": "", "BYTES": "\udcff"}
    decoded = server.decode_request(_client_module().encode_request(request, env, "/tmp", 0o027))
    assert decoded == {"user": "nobody", "cwd": "/tmp", "umask": 0o027, "login": False, "shell": False,
                       "preserve_env": True, "set_home": False, "command": ["printf", "%s\n", "a b", "caf\u00e9"],
                       "preserve_list": ["A"], "assignments": {"X": "1=2"}, "env": env}
    for bad in (b"", b"other/1", b"keepstate-sudo/1\0user", b"keepstate-sudo/1\0bogus\0x"):
        with pytest.raises(ValueError):
            server.decode_request(bad)


def test_env_argv_and_authorization_rules() -> None:
    server = pytest.importorskip("keepstate.agent.sudo_server")
    caller = server.Caller("user", 1000, 1000)
    root = server.Target("root", 0, 0, "/root", "/bin/bash")
    request = {"command": ["env"], "env": {"FOO": "1", "HOME": "/home/user", "LC_ALL": "C", "TERM": "xterm",
                                           "PATH": "/home/user/bin"}}
    env = server.build_env(request, caller, root)
    assert "FOO" not in env and env["LC_ALL"] == "C" and env["TERM"] == "xterm"
    assert (env["HOME"], env["PATH"], env["SUDO_USER"], env["SUDO_UID"], env["USER"]) == (
        "/root", server.SECURE_PATH, "user", "1000", "root")
    env = server.build_env({**request, "preserve_env": True}, caller, root)
    assert (env["FOO"], env["HOME"], env["PATH"]) == ("1", "/home/user", server.SECURE_PATH)
    assert server.build_env({**request, "preserve_env": True, "set_home": True}, caller, root)["HOME"] == "/root"
    assert server.build_env({**request, "preserve_list": ["FOO"], "assignments": {"X": "y"}}, caller, root)["FOO"] \
        == "1"

    def which(program: str, path: str) -> str | None:
        return {"id": "/usr/bin/id"}.get(program)

    assert server.build_argv({"command": ["id", "-u"]}, root, env, which) == ["/usr/bin/id", "-u"]
    assert server.build_argv({"command": ["./x"]}, root, env, which) == ["./x"]
    assert server.build_argv({"command": ["echo", "a b"], "login": True}, root, env, which) == [
        "/bin/bash", "-l", "-c", "echo a\\ b"]
    assert server.build_argv({"command": [], "shell": True, "env": {"SHELL": "/bin/sh"}}, root, env, which) == [
        "/bin/sh"]
    with pytest.raises(server.SudoRefused, match="nope: command not found"):
        server.build_argv({"command": ["nope"]}, root, env, which)
    assert server.authorize(server.Caller("root", 0, 0), set(), "user")
    assert server.authorize(caller, set(), "user")
    assert server.authorize(server.Caller("ann", 1001, 1001), {"ann", "sudo"}, "user")
    assert not server.authorize(server.Caller("nobody", 65534, 65534), {"nogroup"}, "user")


@pytest.fixture
def sudo(sandbox) -> str:  # type: ignore[no-untyped-def]
    """How to call sudo in this sandbox: the template's /usr/local/bin/sudo (installed here if the template does not
    ship it yet), or on the host the client script itself."""
    if not REMOTE:
        return str(CLIENT)
    link = sandbox.commands.run("readlink -f /usr/local/bin/sudo || true", user="root").stdout.strip()
    if link != SANDBOX_CLIENT:
        sandbox.commands.run(f"ln -sf {SANDBOX_CLIENT} /usr/local/bin/sudo", user="root")
    assert sandbox.commands.run("command -v sudo").stdout.strip() == "/usr/local/bin/sudo"
    return "sudo"


def test_sudo_runs_as_root(sandbox, sudo) -> None:
    assert sandbox.commands.run(f"{sudo} -n id -un").stdout == "root\n"
    assert sandbox.commands.run(f"{sudo} id -u").stdout == "0\n"
    assert sandbox.commands.run(f"{sudo} -- id -un").stdout == "root\n"
    assert sandbox.commands.run(f"{sudo} -n apt-get --version").stdout.startswith("apt ")
    assert sandbox.commands.run(f"{sudo} -u nobody id -un").stdout == "nobody\n"
    assert sandbox.commands.run(f"{sudo} sh -c 'id -un; echo $HOME'").stdout == "root\n/root\n"
    assert sandbox.commands.run(f"{sudo} -i pwd").stdout == "/root\n"
    assert sandbox.commands.run(f"{sudo} -s id -un").stdout == "root\n"
    assert sandbox.commands.run(f"cd /tmp && {sudo} pwd").stdout == "/tmp\n"
    for noop in ("-l", "-v", "-k"):
        assert sandbox.commands.run(f"{sudo} {noop}").exit_code == 0


def test_sudo_stdio_and_exit_status(sandbox, sudo) -> None:
    with pytest.raises(CommandExitException) as info:
        sandbox.commands.run(f"printf 'a\\nb\\n' | {sudo} -n sh -c 'cat; echo err >&2; exit 7'")
    assert (info.value.stdout, info.value.stderr, info.value.exit_code) == ("a\nb\n", "err\n", 7)
    handle = sandbox.commands.run(f"{sudo} cat", background=True, stdin=True)
    sandbox.commands.send_stdin(handle.pid, "through sudo\n")
    sandbox.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "through sudo\n"
    with pytest.raises(CommandExitException) as info:
        sandbox.commands.run(f"{sudo} no-such-command-here")
    assert info.value.exit_code == 1 and "command not found" in info.value.stderr


def test_sudo_env_rules(sandbox, sudo) -> None:
    show = "sh -c 'echo \"$FOO|$HOME|$SUDO_USER|$BAR\"'"
    assert sandbox.commands.run(f"FOO=x {sudo} {show}").stdout == "|/root|user|\n"
    assert sandbox.commands.run(f"FOO=x {sudo} -E {show}").stdout == "x|/home/user|user|\n"
    assert sandbox.commands.run(f"FOO=x {sudo} -E -H {show}").stdout == "x|/root|user|\n"
    assert sandbox.commands.run(f"{sudo} BAR=y {show}").stdout == "|/root|user|y\n"


def _root_runs(command: str) -> str:
    """A shell test: whether a root process runs `command` (its program perhaps a full path). That is the relayed
    command itself, not the sudo client asking for it: the client runs as the user."""
    return f"ps -u root -o args= | grep -Eqx '(.*/)?{re.escape(command)}'"


def test_sudo_signals_reach_the_command(sandbox, sudo) -> None:
    mark = f"{uuid.uuid4().int % 1000}.{uuid.uuid4().int % 1000 + 1}"
    # SIGTERM to sudo is relayed; sudo then dies of the same signal, as the shell sees (128 + 15). The signal is
    # sent once the relayed command runs, so it is the relay that is tested, not sudo dying before it asked.
    started = _root_runs(f"sleep 4{mark}")
    out = sandbox.commands.run(
        f"{sudo} sleep 4{mark} & p=$!; for _ in $(seq 400); do {started} && break; sleep 0.05; done; "
        f"{started} || {{ kill -KILL $p; echo 'the relayed command never started' >&2; exit 1; }}; "
        "kill -TERM $p; wait $p; echo $?", timeout=30)
    assert out.stdout == "143\n"
    # Killing the command (its whole process group, sudo included) must not leave the root command behind.
    handle = sandbox.commands.run(f"{sudo} sleep 5{mark}", background=True)
    running = _root_runs(f"sleep 5{mark}")
    assert eventually(lambda: sandbox.commands.run(f"{running} && echo yes || true", user="root").stdout == "yes\n")
    sandbox.commands.kill(handle.pid)
    assert eventually(lambda: f"sleep 5{mark}" not in sandbox.commands.run("ps -eo args", user="root").stdout)
    assert f"sleep 4{mark}" not in sandbox.commands.run("ps -eo args", user="root").stdout


def test_sudo_refuses_users_not_allowed(sandbox, sudo) -> None:
    with pytest.raises(CommandExitException) as info:
        sandbox.commands.run(f"su nobody -s /bin/sh -c '{sudo} -n id'", user="root", cwd="/tmp")
    assert info.value.exit_code == 1
    assert "nobody is not in the sudoers file" in info.value.stderr
    assert "uid=0" not in info.value.stdout


def test_forged_credentials_are_refused_by_the_kernel(sandbox) -> None:
    # Nobody can claim to be root over the socket: the kernel refuses to carry such SCM_CREDENTIALS.
    script = (
        "import os, socket, struct\n"
        "c = socket.socket(socket.AF_UNIX)\n"
        "c.connect(os.environ.get('KEEPSTATE_SUDO_SOCKET') or '/run/keepstate/sudo.sock')\n"
        "try:\n"
        "    c.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack('3i', os.getpid(), 0, 0))])\n"
        "    print('sent')\n"
        "except PermissionError:\n"
        "    print('refused')\n"
    )
    path = f"/tmp/forge-{uuid.uuid4().hex[:8]}.py"
    sandbox.files.write(path, script, user="root")
    try:
        assert sandbox.commands.run(f"python3 {path}", user="nobody", cwd="/tmp").stdout \
            == "refused\n"
    finally:
        sandbox.files.remove(path, user="root")


def test_sudo_commands_are_journaled(sandbox, sudo) -> None:
    from tests.agent.harness import wire_of

    http = wire_of(sandbox).client(authed=True)
    start = http.get("/journal", params={"limit": 0}).json()["last"]
    marker = uuid.uuid4().hex[:8]
    sandbox.commands.run(f"{sudo} -n true {marker}")
    events = http.get("/journal", params={"after": start}).json()["events"]
    runs = [e for e in events if e["data"].get("tag") == "sudo" and marker in e["data"].get("args", [])]
    assert len(runs) == 1
    assert (runs[0]["kind"], runs[0]["data"]["user"]) == ("process.start", "root")
    assert runs[0]["data"]["cmd"].endswith("/true")
    ends = [e for e in events if e["kind"] == "process.exit" and e["data"]["pid"] == runs[0]["data"]["pid"]]
    assert len(ends) == 1 and ends[0]["data"]["exitCode"] == 0
