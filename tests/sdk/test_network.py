"""Egress through the stock SDK: real gVisor sandboxes reaching the fake internet (keepstate.testing.internet) by
name and address as their network policy says, live updates, the always-denied destinations under every policy,
the policy across pause/resume and into a fork, and bad policies refused with nothing created.

Only inside an isolated namespace linked to the fake internet (scripts/test.sh, or scripts/isolated.sh plus
`python -m keepstate.testing.internet up`): there, a rule that let too much through still reaches nothing real.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pytest

from sdkharness import AGENT_PORT, fake_internet, isolated, wait_until

pytestmark = pytest.mark.skipif(not isolated() or fake_internet() is None,
                                reason="needs an isolated network namespace linked to the fake internet "
                                       "(scripts/test.sh, or scripts/isolated.sh + keepstate.testing.internet up)")

PLAIN, OTHER = "198.51.100.10", "198.51.100.13"  # plain.test, other.test (keepstate.testing.internet.NAMES)
GATEWAY_IP = "10.88.255.254"


def curl(sbx: Any, url: str) -> tuple[int, str]:
    """(curl's exit code, HTTP status) of a GET from inside the sandbox. Exit 6: not resolved, 7: refused (a reset
    or an ICMP reject), 28: timed out; a blocked destination must never be 28 (dropped, not refused)."""
    r = sbx.commands.run(f"curl -s -o /dev/null -m 20 -w '%{{http_code}}' {url}; echo \" $?\"", timeout=60)
    code, _, status = r.stdout.strip().rpartition(" ")
    return int(status), code.strip()


def reaches(sbx: Any, url: str) -> bool:
    status, code = curl(sbx, url)
    return status == 0 and code == "200"


def refused(sbx: Any, url: str) -> bool:
    status, _ = curl(sbx, url)
    assert status != 28, f"{url} timed out: a blocked connection must be refused at once, not dropped"
    return status != 0


def test_default_egress_reaches_a_site_by_name(new_sandbox) -> None:
    sbx = new_sandbox()
    assert "10.88.255.254" in sbx.commands.run("cat /etc/resolv.conf").stdout
    assert reaches(sbx, "http://plain.test/")
    assert reaches(sbx, f"http://{OTHER}/")


def test_no_internet_access_fails_fast(new_sandbox) -> None:
    sbx = new_sandbox(allow_internet_access=False)
    assert refused(sbx, "http://plain.test/")
    assert refused(sbx, f"http://{PLAIN}/")
    assert sbx.get_info().allow_internet_access is False


def test_deny_all_with_one_address_allowed(new_sandbox) -> None:
    sbx = new_sandbox(network={"allow_out": [PLAIN], "deny_out": ["0.0.0.0/0"]})
    assert reaches(sbx, f"http://{PLAIN}/")
    assert refused(sbx, f"http://{OTHER}/")


def test_deny_one_address(new_sandbox) -> None:
    sbx = new_sandbox(network={"deny_out": [OTHER]})
    assert refused(sbx, f"http://{OTHER}/")
    assert reaches(sbx, f"http://{PLAIN}/")


def test_live_update_then_clear(new_sandbox) -> None:
    sbx = new_sandbox()
    assert reaches(sbx, "http://plain.test/")
    sbx.update_network({"deny_out": ["0.0.0.0/0"]})
    assert refused(sbx, f"http://{PLAIN}/")
    network = sbx.get_info().network
    assert network is not None and network.get("deny_out") == ["0.0.0.0/0"]
    sbx.update_network({})
    assert reaches(sbx, "http://plain.test/")
    network = sbx.get_info().network
    assert network is not None and not network.get("deny_out")


def sandbox_ip(sbx: Any) -> str:
    out = sbx.commands.run("ip -4 -o addr show eth0").stdout
    return out.split("inet ")[1].split("/")[0]


def test_always_denied_under_every_policy(new_sandbox, server) -> None:
    """Other sandboxes, the metadata address and the host's own services (one listening on every address of the
    host, its link to the fake internet included) stay unreachable, also when the policy sends TCP through the
    egress proxy (names, header rules, a SOCKS5 upstream), which dials on the host's behalf."""
    import http.server
    import threading

    state = fake_internet()
    assert state is not None
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    service = http.server.ThreadingHTTPServer(("0.0.0.0", 0), Handler)
    threading.Thread(target=service.serve_forever, daemon=True).start()
    own = service.server_address[1]
    socks = state["socks"]
    other = new_sandbox()
    other_ip = sandbox_ip(other)
    port = urllib.parse.urlparse(server.url).port
    try:
        for network in ({}, {"allow_out": ["0.0.0.0/0"]},
                        {"allow_out": ["169.254.169.254", "10.0.0.0/8", "127.0.0.1", "203.0.113.1"],
                         "deny_out": ["0.0.0.0/0"]},
                        {"allow_out": ["plain.test"], "deny_out": ["0.0.0.0/0"]},
                        {"rules": {"plain.test": [{"transform": {"headers": {"X-A": "1"}}}]}},
                        {"egress_proxy": {"address": f"{socks['host']}:{socks['port']}"}}):
            sbx = new_sandbox(network=network)
            host_side = ".".join(sandbox_ip(sbx).split(".")[:3] + [str(int(sandbox_ip(sbx).split(".")[3]) - 1)])
            for target in ("http://169.254.169.254/", f"http://{other_ip}:{AGENT_PORT}/health",
                           f"http://{host_side}:{port}/health", f"http://{GATEWAY_IP}:{port}/health",
                           f"http://{host_side}:22/", f"http://{host_side}:{own}/", f"http://203.0.113.1:{own}/",
                           f"http://{GATEWAY_IP}:{own}/"):
                assert refused(sbx, target), f"{target} answered under {network}"
            sbx.kill()
    finally:
        service.shutdown()
    assert hits == [], f"the host's service was reached: {hits}"


def test_policy_survives_pause_and_resume_and_a_fork_inherits_it(new_sandbox) -> None:
    from e2b import Sandbox

    sbx = new_sandbox(network={"allow_out": [PLAIN], "deny_out": ["0.0.0.0/0"]})
    assert refused(sbx, f"http://{OTHER}/")
    assert sbx.pause() is True
    resumed = Sandbox.connect(sbx.sandbox_id)
    assert reaches(resumed, f"http://{PLAIN}/")
    assert refused(resumed, f"http://{OTHER}/")
    children = resumed.fork(count=1)
    child = children[0]
    assert not isinstance(child, Exception), child
    try:
        assert reaches(child, f"http://{PLAIN}/")
        assert refused(child, f"http://{OTHER}/")
    finally:
        child.kill()


def api(server: Any, method: str, path: str, body: Any) -> tuple[int, Any]:
    req = urllib.request.Request(server.url + path, method=method, data=json.dumps(body).encode(),
                                 headers={"X-API-KEY": server.key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read()
            return r.status, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def listed(server: Any) -> set[str]:
    req = urllib.request.Request(server.url + "/v2/sandboxes", headers={"X-API-KEY": server.key})
    with urllib.request.urlopen(req, timeout=30) as r:
        return {s["sandboxID"] for s in json.loads(r.read())}


def test_bad_policies_are_400_and_change_nothing(new_sandbox, server) -> None:
    before = listed(server)
    rule = [{"transform": {"headers": {"X-Key": "${e2b.secrets.no-such-secret}"}}}]
    for network in ({"allowOut": ["10.0.0.300/8"]}, {"allowOut": ["1.2.3.4/33"]}, {"bogus": []},
                    {"denyOut": ["0.0.0.0/0"], "rules": {"plain.test": [{"transform": {"headers": {"X": "1"}}}]}},
                    {"rules": {"plain.test": rule}}, {"egressProxy": {"address": "no-port"}}):
        status, err = api(server, "POST", "/sandboxes", {"templateID": "base", "network": network})
        assert status == 400 and err["code"] == 400 and err["message"], (network, err)
    assert listed(server) <= before
    sbx = new_sandbox(network={"deny_out": [OTHER]})
    for body in ({"denyOut": ["not-a-cidr"]}, {"unknown": True}):
        status, err = api(server, "PUT", f"/sandboxes/{sbx.sandbox_id}/network", body)
        assert status == 400 and err["code"] == 400, (body, err)
    assert refused(sbx, f"http://{OTHER}/") and reaches(sbx, f"http://{PLAIN}/")  # unchanged


def test_bytes_are_counted_and_the_host_is_in_the_history(new_sandbox, server) -> None:
    sbx = new_sandbox()
    sbx.commands.run("curl -s -o /dev/null http://bulk.test:9000/1000000 || true", timeout=60)
    assert reaches(sbx, "http://plain.test/")

    def wire_metrics() -> list[dict[str, Any]]:
        req = urllib.request.Request(f"{server.url}/sandboxes/{sbx.sandbox_id}/metrics",
                                     headers={"X-API-KEY": server.key})
        with urllib.request.urlopen(req, timeout=30) as r:
            return list(json.loads(r.read()))

    wait_until(lambda: any(m.get("networkTxBytes", 0) > 0 and m.get("networkRxBytes", 0) > 0
                           for m in wire_metrics()), 60, "egress byte counts in the metrics")

    def history() -> list[dict[str, Any]]:
        req = urllib.request.Request(f"{server.url}/sandboxes/{sbx.sandbox_id}/events",
                                     headers={"X-API-KEY": server.key})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                data = json.loads(r.read())
        except urllib.error.HTTPError:
            return []
        return data if isinstance(data, list) else data.get("events", [])

    wait_until(lambda: any(e.get("kind") == "egress.host" and e.get("data", {}).get("host") == "plain.test"
                           for e in history()), 60, "an egress.host event naming plain.test")


def test_egress_is_attached_again_after_a_server_restart(e2b_env) -> None:
    """kill -9 of the server, then a restart: its new resolver (a new port) and the sandbox's policy still hold."""
    import os
    import signal
    import tempfile

    from e2b import Sandbox

    from sdkharness import make_key, start_server

    home = tempfile.mkdtemp(prefix="keepstate-egress-restart-")
    srv = start_server(home, pool=0)
    key = make_key(home)
    opts = {"api_key": key, "api_url": srv.url, "sandbox_url": srv.url}
    port = urllib.parse.urlparse(srv.url).port
    try:
        sbx = Sandbox.create(timeout=300, network={"deny_out": [OTHER]}, **opts)
        assert reaches(sbx, "http://plain.test/") and refused(sbx, f"http://{OTHER}/")
        assert srv.proc is not None
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
        srv = start_server(home, port=port, pool=0, extra=("--reap-on-exit",))
        again = Sandbox.connect(sbx.sandbox_id, **opts)
        assert reaches(again, "http://plain.test/")  # by name: the dnat names the new resolver's port
        assert refused(again, f"http://{OTHER}/")
        assert again.kill() is True
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            srv.proc.terminate()
            srv.proc.wait(timeout=60)


def test_domains_allowed_by_name_through_the_proxy(new_sandbox) -> None:
    sbx = new_sandbox(network={"allow_out": ["plain.test", "*.allowed.test"], "deny_out": ["0.0.0.0/0"]})
    assert reaches(sbx, "http://plain.test/")
    assert reaches(sbx, "https://a.allowed.test/")  # spliced: the site's own certificate (the test CA) is trusted
    assert refused(sbx, "http://other.test/")
    assert refused(sbx, f"http://{OTHER}/")
    assert refused(sbx, "http://169.254.169.254/")
    sbx.update_network({})
    assert reaches(sbx, f"http://{OTHER}/") and reaches(sbx, f"http://{PLAIN}/")


HOLD_SCRIPT = r"""
import socket
c = socket.create_connection(("plain.test", 80), timeout=30)
req = b"GET / HTTP/1.1\r\nHost: plain.test\r\n\r\n"
def answer():
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = c.recv(4096)
        if not chunk:
            return "closed"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int([l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0])
    while len(body) < length:
        body += c.recv(4096)
    return head.split(b" ")[1].decode()
c.sendall(req)
first = answer()
open("/tmp/held", "w").write(first + "\n")  # blocks until the test reads it
open("/tmp/go").read()  # blocks until the test has updated the policy
try:
    c.sendall(req)
    second = answer()
except OSError as exc:
    second = "reset"
print(first, second)
"""


def hold(sbx: Any) -> Any:
    """HOLD_SCRIPT running in the sandbox: one keep-alive request to plain.test answered; the FIFOs pace it."""
    sbx.files.write("/tmp/hold.py", HOLD_SCRIPT)
    sbx.commands.run("mkfifo /tmp/held /tmp/go")
    return sbx.commands.run("python3 /tmp/hold.py", background=True)


def test_an_update_cuts_connections_held_through_the_proxy(new_sandbox) -> None:
    """A connection allowed by name (so it ends at the proxy, which conntrack cannot cut) is reset once an update
    denies its host: the next request on it gets no answer."""
    sbx = new_sandbox(network={"allow_out": ["plain.test"], "deny_out": ["0.0.0.0/0"]})
    held = hold(sbx)
    assert sbx.commands.run("cat /tmp/held", timeout=60).stdout.strip() == "200"
    sbx.update_network({"allow_out": ["other.test"], "deny_out": ["0.0.0.0/0"]})
    sbx.commands.run("echo go > /tmp/go", timeout=60)
    first, second = held.wait().stdout.split()
    assert (first, second in ("reset", "closed")) == ("200", True), (first, second)


def test_an_update_that_denies_nothing_more_keeps_held_connections(new_sandbox) -> None:
    sbx = new_sandbox(network={"allow_out": ["plain.test"], "deny_out": ["0.0.0.0/0"]})
    held = hold(sbx)
    assert sbx.commands.run("cat /tmp/held", timeout=60).stdout.strip() == "200"
    sbx.update_network({})  # everything allowed: what it held goes on
    sbx.commands.run("echo go > /tmp/go", timeout=60)
    assert held.wait().stdout.split() == ["200", "200"]


def test_egress_off_lets_nothing_out(e2b_env) -> None:
    """`serve --egress off`: whatever the policy, nothing leaves (as before egress existed)."""
    import tempfile

    from e2b import Sandbox

    from sdkharness import make_key, start_server

    home = tempfile.mkdtemp(prefix="keepstate-egress-off-")
    srv = start_server(home, pool=0, extra=("--reap-on-exit", "--egress", "off"))
    opts = {"api_key": make_key(home), "api_url": srv.url, "sandbox_url": srv.url}
    try:
        sbx = Sandbox.create(timeout=120, **opts)
        assert refused(sbx, f"http://{PLAIN}/")
        assert refused(sbx, "http://169.254.169.254/")
        assert sbx.kill() is True
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            srv.proc.terminate()
            srv.proc.wait(timeout=60)


def test_a_header_rule_sets_a_secret_over_http_and_https(new_sandbox, server) -> None:
    """The whole way: a secret in the store, a rule naming it, the sandbox's request to the header echo carries
    the value (HTTPS too: the sandbox trusts the egress CA /init installed), and the sandbox never holds it."""
    import secrets

    name, value = f"k{secrets.token_hex(4)}", f"v-{secrets.token_hex(8)}"
    status, _ = api(server, "POST", "/secrets", {"name": name, "value": value})
    assert status == 201
    try:
        rule = [{"transform": {"headers": {"X-Api-Key": "${e2b.secrets.%s}" % name}}}]
        sbx = new_sandbox(network={"allow_out": ["echo.test"], "deny_out": ["0.0.0.0/0"],
                                   "rules": {"echo.test": rule}})
        for url in ("http://echo.test/echo", "https://echo.test/echo"):
            r = sbx.commands.run(f"curl -s -m 20 {url}", timeout=60)
            assert json.loads(r.stdout)["headers"].get("x-api-key") == value, (url, r.stdout)
        env = sbx.commands.run("env; cat /etc/resolv.conf", timeout=30).stdout
        assert value not in env
    finally:
        req = urllib.request.Request(f"{server.url}/secrets/{name}", method="DELETE",
                                     headers={"X-API-KEY": server.key})
        with urllib.request.urlopen(req, timeout=30):
            pass
