"""A sandbox cannot read host files, touch other sandboxes, reach host services, or exhaust the host."""

from __future__ import annotations

import os
import secrets
import urllib.parse

import pytest

from sdkharness import AGENT_PORT


def sandbox_ip(sbx) -> str:
    out = sbx.commands.run("ip -4 -o addr show eth0").stdout
    return out.split("inet ")[1].split("/")[0]


def test_host_files_are_not_visible(sandbox, tmp_path) -> None:
    secret = secrets.token_hex(16)
    path = f"/tmp/keepstate-isolation-{secrets.token_hex(4)}"
    with open(path, "w") as f:
        f.write(secret)
    try:
        r = sandbox.commands.run(f"cat {path} 2>/dev/null; grep -rl {secret} /tmp /root /home 2>/dev/null; true",
                                 user="root")
        assert secret not in r.stdout
        # the sandbox's kernel is gVisor's, not the host's
        assert "gVisor" in sandbox.commands.run("dmesg 2>/dev/null | head -n 3 || true", user="root").stdout \
            or sandbox.commands.run("cat /proc/version").stdout != open("/proc/version").read()
    finally:
        os.unlink(path)


def test_other_sandboxes_are_invisible(new_sandbox) -> None:
    a, b = new_sandbox(), new_sandbox()
    marker = "sleep 4242"
    a.commands.run(marker, background=True)
    pid_in_a = a.commands.run("pgrep -f 'sleep 4242'").stdout.split()[0]
    ps_b = b.commands.run("ps aux", user="root").stdout
    assert "4242" not in ps_b
    # the same PID number in B, if it exists at all, is not A's process; A's sleep survives B's kill -9
    b.commands.run(f"kill -9 {pid_in_a} 2>/dev/null; true", user="root")
    assert a.commands.run("pgrep -f 'sleep 4242'").exit_code == 0


def test_network_reaches_neither_host_nor_neighbours(new_sandbox, server) -> None:
    a, b = new_sandbox(), new_sandbox()
    ip_a, ip_b = sandbox_ip(a), sandbox_ip(b)
    assert ip_a != ip_b
    host_side = ".".join(ip_a.split(".")[:3] + [str(int(ip_a.split(".")[3]) - 1)])
    port = urllib.parse.urlparse(server.url).port
    probe = "curl -s -o /dev/null -m 2 -w '%{http_code}' "
    for target in (f"http://{ip_b}:{AGENT_PORT}/health", f"http://{host_side}:{port}/health",
                   f"http://{host_side}:22/", f"http://127.0.0.1:{port}/health", "http://169.254.169.254/"):
        r = a.commands.run(probe + target + " || true")
        assert r.stdout.strip() in ("000", ""), f"{target} answered {r.stdout!r}"
    # while the sandbox's own agent answers on its own address
    assert a.commands.run(probe + f"http://{ip_a}:{AGENT_PORT}/health").stdout.strip() == "204"


def test_host_listener_on_all_interfaces_is_unreachable(sandbox) -> None:
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("0.0.0.0", 0))
    srv.listen()
    port = srv.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        srv.settimeout(8)
        try:
            accepted.append(srv.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    ip = sandbox_ip(sandbox)
    host_side = ".".join(ip.split(".")[:3] + [str(int(ip.split(".")[3]) - 1)])
    r = sandbox.commands.run(f"curl -s -o /dev/null -m 3 -w '%{{http_code}}' http://{host_side}:{port}/ || true")
    t.join()
    srv.close()
    assert r.stdout.strip() == "000"
    assert accepted == []


def test_memory_exhaustion_kills_only_the_sandbox(new_sandbox, server) -> None:
    victim, bystander = new_sandbox(), new_sandbox()
    hog = "python3 -c \"x=[]\nwhile True: x.append(bytearray(64<<20))\""
    try:
        r = victim.commands.run(hog, timeout=120)
        failed = r.exit_code != 0
    except Exception:
        failed = True  # the command was killed, or the whole sandbox was
    assert failed
    assert bystander.commands.run("echo still here").stdout == "still here\n"
    # the host and the server are fine
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(server.url + "/health", timeout=10) as resp:
        assert resp.status == 200


@pytest.mark.parametrize("user", ["user", "root"])
def test_users_and_sudo(sandbox, user: str) -> None:
    r = sandbox.commands.run("id -un; sudo -n id -un", user=user)
    assert r.stdout.split() == [user, "root"]
