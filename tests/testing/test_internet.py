"""The fake internet (keepstate.testing.internet): every server it runs, answered from the test namespace.

Runs only inside an isolated network namespace (scripts/test.sh, scripts/isolated.sh): it uses the fake internet
scripts/test.sh brought up (KEEPSTATE_FAKE_INTERNET), or brings one up of its own for the module.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import dnslib
import pytest

from keepstate.testing.internet import NAMES, SITE_ADDRESSES, FakeInternet, from_state, in_root_netns

pytestmark = pytest.mark.skipif(in_root_netns(), reason="needs an isolated network namespace (scripts/isolated.sh)")

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def internet() -> Iterator[FakeInternet]:
    shared = os.environ.get("KEEPSTATE_FAKE_INTERNET")
    if shared:
        yield from_state(shared)
        return
    fi = FakeInternet(f"t{os.getpid()}")
    fi.up()
    try:
        yield fi
    finally:
        fi.down()


def get(url: str, data: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with OPENER.open(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def https_get(internet: FakeInternet, address: str, server_name: str | None, path: str) -> tuple[str, bytes]:
    """GET over TLS to `address`, sending SNI `server_name` (None: the address, which sends none) and verifying
    the certificate against the test CA; (status line, body)."""
    ctx = ssl.create_default_context(cafile=internet.ca_file)
    with socket.create_connection((address, 443), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=server_name or address) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: {server_name or address}\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode(), body


def dns(name: str, qtype: str = "A", tcp: bool = False) -> dnslib.DNSRecord:
    reply = dnslib.DNSRecord.question(name, qtype).send("198.51.100.53", 53, tcp=tcp, timeout=5)
    return dnslib.DNSRecord.parse(reply)


def test_this_namespace_is_isolated() -> None:
    assert not in_root_netns()


def test_up_refuses_in_the_root_namespace() -> None:
    """Run in the host's root namespace, `up` refuses before it changes anything (no namespace, no route)."""
    root = "/proc/1/ns/net" if os.access("/proc/1/ns/net", os.R_OK) else "/proc/2/ns/net"
    tag = f"refuse{os.getpid()}"
    code = ("import sys\nfrom keepstate.testing.internet import FakeInternet, NotIsolated\n"
            f"try:\n    FakeInternet({tag!r}).up()\nexcept NotIsolated:\n    sys.exit(7)\nsys.exit(1)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["nsenter", f"--net={root}", sys.executable, "-c", code], env=env, capture_output=True)
    assert proc.returncode == 7, proc.stderr.decode()
    cli = subprocess.run(["nsenter", f"--net={root}", sys.executable, "-m", "keepstate.testing.internet", "up",
                          "--state", "/nonexistent/state.json", "--tag", tag], env=env, capture_output=True)
    assert cli.returncode == 2 and b"root network namespace" in cli.stderr
    assert not os.path.exists(f"/run/netns/ksfi-{tag}")


def test_state_names_every_address(internet: FakeInternet) -> None:
    state = internet.state
    assert state["names"] == NAMES and state["addresses"] == SITE_ADDRESSES
    assert state["dns"] == "198.51.100.53" and Path(state["ca_file"]).read_bytes().startswith(b"-----BEGIN CERT")
    assert from_state(state["state_file"]).state == state


@pytest.mark.parametrize("tcp", [False, True], ids=["udp", "tcp"])
def test_dns_answers_the_table_and_nxdomain_otherwise(internet: FakeInternet, tcp: bool) -> None:
    for name, address in NAMES.items():
        r = dns(name, tcp=tcp)
        assert r.header.rcode == dnslib.RCODE.NOERROR
        assert [str(rr.rdata) for rr in r.rr] == [address]
    assert dns("NOPE.test", tcp=tcp).header.rcode == dnslib.RCODE.NXDOMAIN
    r = dns("plain.test", "AAAA", tcp=tcp)
    assert r.header.rcode == dnslib.RCODE.NOERROR and not r.rr
    status, body = get("http://198.51.100.80:8080/dns-log")
    assert status == 200 and any(q["name"] == "nope.test" for q in json.loads(body))


def test_every_site_answers_with_its_name(internet: FakeInternet) -> None:
    sites = internet.state["sites"]
    for address in SITE_ADDRESSES:
        assert get(f"http://{address}/") == (200, f"site {sites[address]}".encode())
    assert sites["198.51.100.10"] == "plain.test" and sites["198.51.100.25"] == "198.51.100.25"


def test_echo_over_http(internet: FakeInternet) -> None:
    status, body = get("http://198.51.100.20/echo?x=1", headers={"X-Probe": "one", "Host": "echo.test"})
    echo = json.loads(body)
    assert status == 200 and echo["headers"]["x-probe"] == "one" and echo["host"] == "echo.test"
    assert echo["peer"].startswith("203.0.113.1:") and echo["sni"] is None and echo["scheme"] == "http"
    assert echo["path"] == "/echo?x=1" and echo["site"] == "echo.test"


def test_https_with_the_test_ca_and_sni(internet: FakeInternet) -> None:
    status, body = https_get(internet, "198.51.100.11", "a.allowed.test", "/echo")
    echo = json.loads(body)
    assert status.endswith("200 OK") and echo["sni"] == "a.allowed.test" and echo["scheme"] == "https"
    assert https_get(internet, "198.51.100.12", "b.allowed.test", "/") == ("HTTP/1.1 200 OK", b"site b.allowed.test")
    # The leaf names the address too: reached by address (no SNI) it still verifies.
    status, body = https_get(internet, "198.51.100.10", None, "/echo")
    assert json.loads(body)["sni"] is None
    # ...and only its own name: another site's name fails verification.
    with pytest.raises(ssl.SSLCertVerificationError):
        https_get(internet, "198.51.100.10", "other.test", "/")


def test_bytes_and_sink(internet: FakeInternet) -> None:
    status, body = get("http://198.51.100.10/bytes?n=1000000")
    assert status == 200 and len(body) == 1000000
    assert get("http://198.51.100.10/bytes?n=-1")[0] == 400
    status, body = get("http://198.51.100.10/sink", data=b"x" * 300000)
    assert json.loads(body) == {"received": 300000}
    chunks = (b"y" * 1000 for _ in range(7))
    req = urllib.request.Request("http://198.51.100.10/sink", data=chunks, method="POST",
                                 headers={"Transfer-Encoding": "chunked"})
    with OPENER.open(req, timeout=10) as r:
        assert json.loads(r.read()) == {"received": 7000}
    assert get("http://198.51.100.10/nothing")[0] == 404


def socks_connect(port: int, target: tuple[str, int] | tuple[str, int, str], auth: tuple[str, str] | None = None,
                  offer: bytes | None = None) -> tuple[socket.socket, int]:
    """A SOCKS5 CONNECT to `target` (an IPv4 address, or a name with "domain" as third item); (socket, reply code)."""
    s = socket.create_connection(("198.51.100.80", port), timeout=10)
    s.sendall(b"\x05" + bytes([len(offer)]) + offer if offer else (b"\x05\x01\x02" if auth else b"\x05\x01\x00"))
    method = s.recv(2)
    if method[1] == 0xFF:
        return s, -1
    if method[1] == 2:
        assert auth is not None
        u, p = auth[0].encode(), auth[1].encode()
        s.sendall(b"\x01" + bytes([len(u)]) + u + bytes([len(p)]) + p)
        if s.recv(2) != b"\x01\x00":
            return s, -2
    host, tport = target[0], target[1]
    if len(target) == 3:
        addr = b"\x03" + bytes([len(host)]) + host.encode()
    else:
        addr = b"\x01" + socket.inet_aton(host)
    s.sendall(b"\x05\x01\x00" + addr + tport.to_bytes(2, "big"))
    reply = s.recv(10)
    return s, reply[1]


def http_over(s: socket.socket, host: str) -> bytes:
    s.sendall(f"GET /echo HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data.partition(b"\r\n\r\n")[2]


def socks_log() -> list[dict[str, object]]:
    status, body = get("http://198.51.100.80:8080/log")
    assert status == 200
    return list(json.loads(body))


def test_socks5_without_auth(internet: FakeInternet) -> None:
    since = time.time()
    s, code = socks_connect(1080, ("echo.test", 80, "domain"))
    ours = f"203.0.113.1:{s.getsockname()[1]}"
    with s:
        assert code == 0
        echo = json.loads(http_over(s, "echo.test"))
    assert echo["peer"].startswith("198.51.100.") and echo["site"] == "echo.test"
    s, code = socks_connect(1080, ("198.51.100.13", 80))
    with s:
        assert code == 0 and json.loads(http_over(s, "other.test"))["site"] == "other.test"
    entries = mine(ours, since)
    assert [(e["target"], e["atyp"], e["result"]) for e in entries] == [("echo.test:80", "domain", "ok")]
    s, code = socks_connect(1080, ("nowhere.test", 80, "domain"))
    s.close()
    assert code == 4  # host unreachable: a name the table does not have
    s, code = socks_connect(1080, ("198.51.100.10", 9))
    s.close()
    assert code == 5  # refused: nothing listens there


def mine(peer: str, since: float) -> list[dict]:
    """The SOCKS log's entries of this connection: its address, from `since` on (a source port is used again by
    other connections over a run: matched by address alone, an earlier test's entry was taken for ours)."""
    return [e for e in socks_log() if e["peer"] == peer and e["time"] >= since]


def test_socks5_with_user_and_password(internet: FakeInternet) -> None:
    since = time.time()
    s, code = socks_connect(1081, ("plain.test", 80, "domain"), auth=("u", "p"))
    ours = f"203.0.113.1:{s.getsockname()[1]}"
    with s:
        assert code == 0 and json.loads(http_over(s, "plain.test"))["site"] == "plain.test"
    assert [e["user"] for e in mine(ours, since)] == ["u"]
    s, code = socks_connect(1081, ("plain.test", 80, "domain"), auth=("u", "wrong"))
    s.close()
    assert code == -2
    s, code = socks_connect(1081, ("plain.test", 80, "domain"), offer=b"\x00")
    s.close()
    assert code == -1  # no acceptable method: this one requires user/password


def test_bulk_server(internet: FakeInternet) -> None:
    status, body = get("http://203.0.113.50:9000/bytes?n=20000000")
    assert status == 200 and len(body) == 20000000 and body.count(0) == len(body)
    status, body = get("http://203.0.113.50:9000/sink", data=b"z" * 5000000)
    assert status == 200 and json.loads(body) == {"received": 5000000}


def test_no_route_beyond_the_fake_internet(internet: FakeInternet) -> None:
    """An address the fake internet does not hold is unreachable at once (ICMP), never routed further."""
    with pytest.raises(OSError) as err:
        socket.create_connection(("198.51.100.99", 80), timeout=10)
    assert not isinstance(err.value, TimeoutError)


LIFECYCLE = """
import json, os, subprocess, sys, urllib.request
from keepstate.testing.internet import FakeInternet
def sh(*a):
    return subprocess.run(list(a), capture_output=True, text=True).stdout
def site():
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    return opener.open("http://198.51.100.10/", timeout=10).read().decode()
tag = sys.argv[1]
fi = FakeInternet(tag)
state = fi.up()
pids = list(state["pids"])
seen = {"route": sh("ip", "route", "show", "default"), "netns": os.path.exists(fi.netns_path),
        "pids": [os.path.exists(f"/proc/{p}") for p in pids], "site": site()}
try:
    FakeInternet(tag + "b").up()  # a second one here: refused before it makes anything
    seen["second"] = "up"
except FileExistsError as e:
    seen["second"] = str(e)
seen["second_netns"] = os.path.exists(f"/run/netns/ksfi-{tag}b")
seen["first_after_second"] = {"route": sh("ip", "route", "show", "default"), "site": site()}
fi.down()
fi.down()  # twice: nothing left to do
seen["after"] = {"route": sh("ip", "route", "show", "default"), "link": sh("ip", "-br", "link", "show", "ksfi0"),
                 "netns": os.path.exists(fi.netns_path), "dir": os.path.exists(state["dir"]),
                 "pids": [os.path.exists(f"/proc/{p}") for p in pids]}
print(json.dumps(seen))
"""


def test_up_then_down_leaves_nothing() -> None:
    """In a namespace of its own: up links it (default route via the fake internet, servers running); a second
    up there is refused and leaves the first intact; down removes the namespace, link, route, servers and files."""
    tag = f"life{os.getpid()}"
    out = subprocess.run(["bash", str(REPO / "scripts" / "isolated.sh"), sys.executable, "-c", LIFECYCLE, tag],
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["route"].startswith("default via 203.0.113.2 dev ksfi0") and seen["netns"]
    assert seen["pids"] == [True, True] and seen["site"] == "site plain.test"
    assert "already has a fake internet" in seen["second"] and not seen["second_netns"]
    assert seen["first_after_second"] == {"route": seen["route"], "site": "site plain.test"}
    assert seen["after"] == {"route": "", "link": "", "netns": False, "dir": False, "pids": [False, False]}


def test_sdkharness_reads_the_same_state(internet: FakeInternet, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK tests' harness (no keepstate imports) sees the same namespace and fake internet."""
    from tests.sdk import sdkharness

    assert sdkharness.isolated()
    monkeypatch.setenv("KEEPSTATE_FAKE_INTERNET", internet.state["state_file"])
    assert sdkharness.fake_internet() == internet.state
    flags = sdkharness.fake_internet_flags()
    assert set(flags) <= {"--dns-upstream", "198.51.100.53", "--egress-ca-bundle", internet.ca_file}
    monkeypatch.delenv("KEEPSTATE_FAKE_INTERNET")
    assert sdkharness.fake_internet() is None and sdkharness.fake_internet_flags() == ()
