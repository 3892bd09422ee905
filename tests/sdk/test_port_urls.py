"""Port URLs (docs/design/network.md, "Inbound"): the stock SDK's `get_host(port)` names `<port>-<id>.<domain>` on
this server, and the router serves it, over HTTP and over its TLS listener, with E2B's traffic token, Host mask,
HTTPS ports and autoResume.

This module starts its own server (`--domain`, `--tls-self-signed`, `--tls-listen` on 127.0.0.1), and reaches port
URLs by connecting to 127.0.0.1 with the URL's Host (and, over TLS, its SNI name): no DNS at all.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from sdkharness import Server, free_port, make_key, start_server, wait_until

ECHO_PORT, TLS_ECHO_PORT = 8000, 8443
# The server inside: answers every GET with what it was sent (path, headers), over TLS when given a cert and key.
ECHO = r"""
import http.server, json, ssl, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
srv = http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H)
if len(sys.argv) > 2:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(sys.argv[2], sys.argv[3])
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
srv.serve_forever()
"""


class Ports:
    """This module's server: the plain listener, the TLS one, the domain, the router's CA."""

    def __init__(self, server: Server, tls_port: int, domain: str) -> None:
        self.server, self.tls_port, self.domain = server, tls_port, domain
        self.plain = server.url
        self.tls = f"https://127.0.0.1:{tls_port}"
        self.ca = os.path.join(server.home, "tls", "router-ca.pem")

    def get(self, host: str, path: str = "/hello", headers: dict[str, str] | None = None,
            tls: bool = False) -> httpx.Response:
        """GET `path` of the port URL `host` (`<port>-<id>.<domain>`), through the plain listener or the TLS one
        (verified with the router's CA, SNI = the host name)."""
        name = host.rsplit(":", 1)[0]
        verify: Any = ssl.create_default_context(cafile=self.ca) if tls else False
        with httpx.Client(trust_env=False, verify=verify, timeout=120) as client:
            return client.get((self.tls if tls else self.plain) + path, headers={"Host": host, **(headers or {})},
                              extensions={"sni_hostname": name} if tls else {})

    def api(self, method: str, path: str) -> Any:
        req = urllib.request.Request(self.plain + path, method=method, headers={"X-API-KEY": self.server.key})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read() or b"null")

    def resumes(self, sandbox_id: str) -> int:
        events = self.api("GET", f"/sandboxes/{sandbox_id}/events")["events"]
        return sum(1 for e in events if e["kind"] == "sandbox.resume")


@pytest.fixture(scope="module")
def ports() -> Iterator[Ports]:
    home = tempfile.mkdtemp(prefix="keepstate-ports-")
    tls_port = free_port()
    domain = f"ports.test:{tls_port}"
    srv = start_server(home, pool=0, extra=("--reap-on-exit", "--domain", domain, "--tls-self-signed",
                                            "--tls-listen", f"127.0.0.1:{tls_port}"))
    srv.key = make_key(home)
    try:
        yield Ports(srv, tls_port, domain)
    finally:
        assert srv.proc is not None
        srv.proc.terminate()
        srv.proc.wait(timeout=60)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def e2b_env(ports: Ports) -> Iterator[None]:
    """This module's server, not the session's (the conftest's fixture of the same name is overridden), for this
    module only: the session's is back afterwards."""
    names = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DEBUG", "NO_PROXY")
    saved = {n: os.environ.get(n) for n in names}
    os.environ.update({"E2B_API_URL": ports.plain, "E2B_SANDBOX_URL": ports.plain, "E2B_API_KEY": ports.server.key,
                       "NO_PROXY": "127.0.0.1,localhost"})
    os.environ.pop("E2B_DEBUG", None)
    yield
    for n, v in saved.items():
        if v is None:
            os.environ.pop(n, None)
        else:
            os.environ[n] = v


@pytest.fixture(scope="module")
def made() -> Iterator[list[Any]]:
    sandboxes: list[Any] = []
    yield sandboxes
    for sbx in sandboxes:
        try:
            sbx.kill()
        except Exception:
            pass


def create(made: list[Any], **kw: Any) -> Any:
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=600, **kw)
    made.append(sbx)
    return sbx


def serve_echo(ports: Ports, sbx: Any, port: int = ECHO_PORT, tls: bool = False,
               headers: dict[str, str] | None = None) -> None:
    sbx.files.write("/tmp/echo.py", ECHO)
    args = ""
    if tls:
        sbx.commands.run("openssl req -x509 -newkey rsa:2048 -nodes -keyout /tmp/k.pem -out /tmp/c.pem -days 1 "
                         "-subj /CN=sandbox 2>/dev/null")
        args = " /tmp/c.pem /tmp/k.pem"
    sbx.commands.run(f"python3 /tmp/echo.py {port}{args}", background=True)
    host = sbx.get_host(port)
    wait_until(lambda: ports.get(host, headers=headers).status_code == 200, 60,
               f"the echo server on port {port} of {sbx.sandbox_id}")


@pytest.fixture(scope="module")
def public(ports: Ports, made: list[Any]) -> Any:
    sbx = create(made)
    serve_echo(ports, sbx)
    return sbx


def test_get_host_names_our_domain(ports: Ports, public: Any) -> None:
    assert public.get_host(ECHO_PORT) == f"{ECHO_PORT}-{public.sandbox_id}.{ports.domain}"
    info = ports.api("GET", f"/sandboxes/{public.sandbox_id}")
    assert info["domain"] == ports.domain and info["trafficAccessToken"] is None
    listed = [s for s in ports.api("GET", "/v2/sandboxes") if s["sandboxID"] == public.sandbox_id]
    assert listed and listed[0]["domain"] == ports.domain


def test_port_url_over_http(ports: Ports, public: Any) -> None:
    r = ports.get(public.get_host(ECHO_PORT), "/some/path?x=1")
    assert r.status_code == 200
    seen = r.json()
    assert seen["path"] == "/some/path?x=1"
    assert seen["headers"]["host"].startswith("10.88.")  # no mask: the sandbox's own address


def test_port_url_over_tls_with_the_router_ca(ports: Ports, public: Any) -> None:
    host = public.get_host(ECHO_PORT)
    r = ports.get(host, "/tls", tls=True)
    assert r.status_code == 200 and r.json()["path"] == "/tls"
    # The leaf names exactly this host, signed by the router's CA; a client that does not trust it refuses.
    with pytest.raises(httpx.ConnectError):
        with httpx.Client(trust_env=False, verify=ssl.create_default_context(), timeout=30) as c:
            c.get(ports.tls + "/", headers={"Host": host}, extensions={"sni_hostname": host.rsplit(":", 1)[0]})


def test_closed_port_is_a_json_502(ports: Ports, public: Any) -> None:
    r = ports.get(public.get_host(8999))
    assert r.status_code == 502 and r.json()["code"] == 502 and "port is not open" in r.json()["message"]


@pytest.fixture(scope="module")
def private(ports: Ports, made: list[Any]) -> Any:
    sbx = create(made, network={"allow_public_traffic": False, "mask_request_host": "${PORT}-masked.test",
                                "https_ports": [TLS_ECHO_PORT]})
    assert sbx.traffic_access_token
    serve_echo(ports, sbx, headers={"e2b-traffic-access-token": sbx.traffic_access_token})
    return sbx


def test_private_ports_need_the_traffic_token(ports: Ports, private: Any) -> None:
    host = private.get_host(ECHO_PORT)
    for headers in ({}, {"e2b-traffic-access-token": "wrong"}):
        for tls in (False, True):
            r = ports.get(host, headers=headers, tls=tls)
            assert r.status_code == 403, r.text
            assert r.json()["code"] == 403 and "e2b-traffic-access-token" in r.json()["message"]
    r = ports.get(host, headers={"e2b-traffic-access-token": private.traffic_access_token}, tls=True)
    assert r.status_code == 200
    assert "e2b-traffic-access-token" not in r.json()["headers"]  # it stops at the router
    # The agent has its own token: the SDK needs no traffic token.
    assert private.commands.run("echo agent").stdout.strip() == "agent"
    info = ports.api("GET", f"/sandboxes/{private.sandbox_id}")
    assert info["trafficAccessToken"] == private.traffic_access_token


def test_mask_request_host_is_the_host_the_sandbox_sees(ports: Ports, private: Any) -> None:
    r = ports.get(private.get_host(ECHO_PORT), headers={"e2b-traffic-access-token": private.traffic_access_token})
    assert r.status_code == 200 and r.json()["headers"]["host"] == f"{ECHO_PORT}-masked.test"


def test_https_ports_are_relayed_over_tls(ports: Ports, private: Any) -> None:
    if private.commands.run("command -v openssl || true").stdout.strip() == "":
        pytest.skip("the template has no openssl to make the sandbox's certificate")
    token = {"e2b-traffic-access-token": private.traffic_access_token}
    serve_echo(ports, private, TLS_ECHO_PORT, tls=True, headers=token)
    r = ports.get(private.get_host(TLS_ECHO_PORT), "/over-tls", headers=token)
    assert r.status_code == 200 and r.json()["path"] == "/over-tls"


def test_bad_network_and_auto_resume_are_400s(ports: Ports) -> None:
    for body in ({"network": {"allowPublicTraffic": "no"}}, {"network": {"maskRequestHost": "a b"}},
                 {"network": {"httpsPorts": [0]}}, {"autoResume": {"enabled": "yes"}},
                 {"autoResume": {"enabled": True}}, {"autoPause": True, "autoPauseMemory": False,
                                                      "autoResume": {"enabled": True}}):
        req = urllib.request.Request(ports.plain + "/sandboxes", method="POST",
                                     data=json.dumps({"templateID": "base", **body}).encode(),
                                     headers={"X-API-KEY": ports.server.key, "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=60)
        assert err.value.code == 400
        assert json.loads(err.value.read())["code"] == 400


@pytest.fixture(scope="module")
def waking(ports: Ports, made: list[Any]) -> Any:
    sbx = create(made, lifecycle={"on_timeout": "pause", "auto_resume": True})
    serve_echo(ports, sbx)
    return sbx


def test_lifecycle_shows_auto_resume(ports: Ports, waking: Any, public: Any) -> None:
    assert waking.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
    assert public.get_info().lifecycle == {"on_timeout": "kill", "auto_resume": False}


def test_traffic_resumes_a_paused_sandbox_once(ports: Ports, waking: Any) -> None:
    host = waking.get_host(ECHO_PORT)
    before = ports.resumes(waking.sandbox_id)
    waking.pause()
    assert waking.get_info().state.value == "paused"
    answers: list[httpx.Response | BaseException] = []

    def one(i: int) -> None:
        try:
            answers.append(ports.get(host, f"/wake/{i}", tls=i % 2 == 1))
        except BaseException as exc:  # noqa: BLE001 - reported below
            answers.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(answers) == 6
    assert all(isinstance(a, httpx.Response) and a.status_code == 200 for a in answers), answers
    assert sorted(a.json()["path"] for a in answers if isinstance(a, httpx.Response)) == [f"/wake/{i}"
                                                                                         for i in range(6)]
    assert waking.get_info().state.value == "running"
    assert ports.resumes(waking.sandbox_id) == before + 1


def test_traffic_resumes_a_sandbox_its_timeout_paused(ports: Ports, waking: Any) -> None:
    waking.set_timeout(1)
    wait_until(lambda: waking.get_info().state.value == "paused", 60, "the timeout's auto-pause")
    r = ports.get(waking.get_host(ECHO_PORT), "/after-timeout")
    assert r.status_code == 200 and r.json()["path"] == "/after-timeout"
    info = waking.get_info()
    assert info.state.value == "running"
    # It runs for its create-time timeout again (600 s), as E2B's auto-resume gives it.
    assert (info.end_at - datetime.now(UTC)).total_seconds() > 300


def test_agent_traffic_resumes_it_too(ports: Ports, waking: Any) -> None:
    waking.pause()
    assert waking.get_info().state.value == "paused"
    assert waking.commands.run("echo awake").stdout.strip() == "awake"
    assert waking.get_info().state.value == "running"


def test_without_auto_resume_a_paused_sandbox_answers_json(ports: Ports, public: Any) -> None:
    public.pause()
    r = ports.get(public.get_host(ECHO_PORT))
    assert r.status_code == 502
    assert r.json()["code"] == 502 and "paused" in r.json()["message"]
    assert public.get_info().state.value == "paused"
