"""Inbound without sandboxes: the create's `autoResume` and `network` fields, the domain, the router's TLS leaves
(real handshakes in memory), and a `--runtime fake` server's default domain over its TLS listener.

The port URLs themselves, with real sandboxes and the stock SDK, are tests/sdk/test_port_urls.py.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from keepstate.api import listeners, schemas
from keepstate.egress.ca import CA
from keepstate.egress.policy import Policy
from keepstate.errors import BadRequest
from keepstate.sandbox.traffic import traffic_token
from tests.sdk.sdkharness import KEEPSTATE, free_port, make_key, start_server


@pytest.mark.parametrize("value,enabled", [(None, False), (False, False), (True, True), ({"enabled": True}, True),
                                           ({"enabled": False}, False), ({"policy": "any"}, True),
                                           ({"policy": "off"}, False)])
def test_auto_resume_shapes(value: object, enabled: bool) -> None:
    assert schemas.parse_auto_resume(value) is enabled


@pytest.mark.parametrize("value", [{"enabled": "yes"}, {"policy": "some"}, {}, {"enabled": True, "x": 1}, 1, "on"])
def test_bad_auto_resume(value: object) -> None:
    with pytest.raises(BadRequest):
        schemas.parse_auto_resume(value)


def test_create_takes_network_and_auto_resume() -> None:
    req = schemas.parse_create({"templateID": "base", "autoPause": True, "autoResume": {"enabled": True},
                                "network": {"allowPublicTraffic": False, "maskRequestHost": "${PORT}-x.test",
                                            "httpsPorts": [8443]}})
    assert req.auto_resume is True
    policy = Policy.from_json(req.network)
    assert (policy.allow_public_traffic, policy.mask_request_host, policy.https_ports) == (False, "${PORT}-x.test",
                                                                                          (8443,))
    token = traffic_token(req.network)
    assert token and token != traffic_token(req.network)  # a fresh one per sandbox
    assert traffic_token(schemas.parse_create({"templateID": "base"}).network) is None


@pytest.mark.parametrize("body", [{"autoResume": {"enabled": True}},
                                  {"autoPause": True, "autoPauseMemory": False, "autoResume": {"enabled": True}},
                                  {"network": {"allowPublicTraffic": 0}}, {"network": {"nope": 1}},
                                  {"network": {"maskRequestHost": "a/b"}}, {"network": []}])
def test_bad_creates(body: dict[str, object]) -> None:
    with pytest.raises(BadRequest):
        schemas.parse_create({"templateID": "base", **body})


@pytest.mark.parametrize("domain,host", [("localhost:3443", "localhost"), ("Ports.Test", "ports.test"),
                                         ("[::1]:3443", "::1"), ("a.test:80", "a.test")])
def test_domain_host(domain: str, host: str) -> None:
    assert listeners.domain_host(domain) == host


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext, name: str | None) -> ssl.SSLObject:
    """A TLS handshake in memory (no sockets); the client's SSLObject after it."""
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(c_in, c_out, server_hostname=name)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    done = [False, False]
    for _ in range(10):
        for i, obj in enumerate((c, s)):
            if not done[i]:
                try:
                    obj.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done):
            return c
    raise AssertionError("handshake did not finish")


def test_self_signed_leaves_per_sni_name() -> None:
    ca = CA.create("test router CA")
    server = listeners.self_signed_context(ca, "ports.test:3443")
    client = ssl.create_default_context(cadata=ca.cert_pem.decode())
    for name in ("8000-abc.ports.test", "49983-xyz.ports.test", "ports.test"):
        cert = _handshake(server, client, name).getpeercert()
        assert ("DNS", name) in cert["subjectAltName"]
    # No SNI (an IP address): the default leaf, which names loopback.
    client_ip = ssl.create_default_context(cadata=ca.cert_pem.decode())
    cert = _handshake(server, client_ip, "127.0.0.1").getpeercert()
    assert ("IP Address", "127.0.0.1") in cert["subjectAltName"]
    # A name outside the domain gets no leaf of its own: the client refuses the default one.
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(server, client, "bank.example.test")


@pytest.fixture(scope="module")
def fake_tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, str, str]]:
    home = str(tmp_path_factory.mktemp("inbound-home"))
    tls_port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KEEPSTATE_VALIDATE_RESPONSES", "1")
        srv = start_server(home, pool=0, extra=("--runtime", "fake", "--warm", "base", "--reap-on-exit",
                                                "--tls-self-signed", "--tls-listen", f"127.0.0.1:{tls_port}"))
    try:
        yield srv.url, tls_port, make_key(home), home
    finally:
        assert srv.proc is not None
        srv.proc.terminate()
        srv.proc.wait(timeout=60)


def test_default_domain_names_the_tls_port(fake_tls_server: tuple[str, int, str, str]) -> None:
    url, tls_port, key, home = fake_tls_server
    req = urllib.request.Request(f"https://127.0.0.1:{tls_port}/sandboxes", method="POST",
                                 data=json.dumps({"templateID": "base"}).encode(),
                                 headers={"X-API-KEY": key, "Content-Type": "application/json"})
    env = {**os.environ, "KEEPSTATE_HOME": home}
    ca = subprocess.check_output([str(KEEPSTATE), "tls", "trust"], env=env, stderr=subprocess.DEVNULL).decode()
    ctx = ssl.create_default_context(cafile=ca.strip())  # the CA `keepstate tls trust` names is the server's
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))
    with opener.open(req, timeout=60) as r:
        body = json.loads(r.read())
    assert body["domain"] == f"localhost:{tls_port}"
    assert body["trafficAccessToken"] is None


def test_plan_listeners_and_domain(tmp_path: Path) -> None:
    sites, domain = listeners.plan(tmp_path, "127.0.0.1", 3000, None, None, None, False, None)
    assert domain == "localhost:3000" and [s.url for s in sites] == ["http://127.0.0.1:3000"]
    sites, domain = listeners.plan(tmp_path, "127.0.0.1", 3000, None, None, None, True, None)
    assert domain == "localhost:3443" and [s.url for s in sites] == ["http://127.0.0.1:3000", "https://127.0.0.1:3443"]
    assert (tmp_path / "tls" / "router-ca.pem").exists()
    sites, domain = listeners.plan(tmp_path, "127.0.0.1", 3000, "Sbx.Example.Test", None, None, True, "0.0.0.0:8443")
    assert domain == "sbx.example.test" and sites[1].url == "https://0.0.0.0:8443"


def test_listening_sockets_defer_accept_and_refuse_a_taken_port() -> None:
    port = free_port()
    socks = listeners.listening_sockets("127.0.0.1", port)
    try:
        assert [s.getsockname() for s in socks] == [("127.0.0.1", port)]
        assert socks[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT) > 0
        socks[0].listen()
        with pytest.raises(OSError):  # taken: an error at start, as TCPSite's was
            listeners.listening_sockets("127.0.0.1", port)
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("args", [("cert.pem", None, False, None), ("cert.pem", "key.pem", True, None),
                                  (None, None, False, "127.0.0.1:3443"), (None, None, True, "127.0.0.1:http")])
def test_plan_refuses_options_that_do_not_go_together(tmp_path: Path, args: tuple[object, ...]) -> None:
    with pytest.raises(ValueError):
        listeners.plan(tmp_path, "127.0.0.1", 3000, None, *args)  # type: ignore[arg-type]


@pytest.mark.parametrize("domain", ["http://x.test", "x.test/path", ".x.test", "a b"])
def test_plan_refuses_a_domain_that_is_not_a_host(tmp_path: Path, domain: str) -> None:
    with pytest.raises(ValueError):
        listeners.plan(tmp_path, "127.0.0.1", 3000, domain, None, None, False, None)


def test_operator_certificate(tmp_path: Path) -> None:
    ca = CA.create("operator CA")
    cert, key = ca.issue("*.sbx.example.test")
    (tmp_path / "c.pem").write_bytes(cert + ca.cert_pem)
    (tmp_path / "k.pem").write_bytes(key)
    sites, _ = listeners.plan(tmp_path, "127.0.0.1", 3000, "sbx.example.test", str(tmp_path / "c.pem"),
                              str(tmp_path / "k.pem"), False, None)
    assert sites[1].ssl_context is not None
    client = ssl.create_default_context(cadata=ca.cert_pem.decode())
    peer = _handshake(sites[1].ssl_context, client, "8000-abc.sbx.example.test").getpeercert()
    assert ("DNS", "*.sbx.example.test") in peer["subjectAltName"]
    with pytest.raises(ValueError):
        listeners.plan(tmp_path, "127.0.0.1", 3000, None, str(tmp_path / "k.pem"), str(tmp_path / "k.pem"), False,
                       None)
