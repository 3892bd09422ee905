"""The egress proxy with real sockets on loopback and real TLS.

The datapath's dnat is played by the `original_dst` seam: each test takes a fresh client address (127.1.0.N, which
Linux lets a client bind to) and says what policy that "sandbox" has and which real server on 127.0.0.1 its
connections were going to. The guard allows 127.0.0.1 (the test's servers) and denies every other address, as the
always-denied set would. Upstream servers: an aiohttp header echo over HTTP and over HTTPS (a test CA), raw TCP
servers for opaque protocols, and the fake internet's SOCKS5 server (run on loopback here).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import socket
import ssl
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from keepstate.egress.ca import CA
from keepstate.egress.policy import Policy, parse
from keepstate.egress.proxy import Proxy
from keepstate.testing.internet_socks import serve_socks

SECRETS = {"api_key": "sk-VALUE-never-shown-1234", "other": "second-VALUE-5678", "broken": "a\r\nInjected: yes"}
NAMES = ["api.rule.test", "*.allowed.test", "other.test", "plain.test", "ws.rule.test"]
RULES = {"api.rule.test": [{"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.API_KEY}",
                                                      "X-Static": "fixed"}}}],
         "ws.rule.test": [{"transform": {"headers": {"X-Key": "${e2b.secrets.other}"}}}],
         "gone.rule.test": [{"transform": {"headers": {"X-Ok": "${e2b.secrets.api_key}",
                                                       "X-Gone": "k=${e2b.secrets.missing_one}"}}}],
         "bad.rule.test": [{"transform": {"headers": {"X-Bad": "${e2b.secrets.broken}"}}}],
         "err.rule.test": [{"transform": {"headers": {"X-Err": "${e2b.secrets.explodes}"}}}]}


def secrets_of(values: dict[str, str]) -> Callable[[str], Awaitable[str | None]]:
    """The proxy's `secret_value` (the secret store's async `value`) over a dict."""

    async def value(name: str) -> str | None:
        return values.get(name)

    return value


async def secret_value(name: str) -> str | None:
    if name == "explodes":  # as the store does when a value does not decrypt
        raise RuntimeError("the secret does not decrypt with this key")
    return SECRETS.get(name)


def ssl_server_context(ca: CA, *names: str) -> ssl.SSLContext:
    cert, key = ca.issue(*names)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "c.pem").write_bytes(cert)
        (Path(d) / "k.pem").write_bytes(key)
        ctx.load_cert_chain(Path(d) / "c.pem", Path(d) / "k.pem")
    return ctx


def trusting(*cas: CA) -> ssl.SSLContext:
    return ssl.create_default_context(cadata="".join(ca.cert_pem.decode() for ca in cas))


# --- upstream servers ------------------------------------------------------------------------------------------

@dataclass
class Upstreams:
    http: int = 0
    https: int = 0
    reverse: int = 0  # reads to EOF, answers the bytes reversed, closes
    banner: int = 0  # speaks first
    seen: list[dict[str, Any]] = field(default_factory=list)  # every request the echo servers answered


UPS = web.AppKey("ups", Upstreams)


async def echo(request: web.Request) -> web.StreamResponse:
    ups = request.app[UPS]
    if request.path == "/chunked":  # a response in pieces, without a length
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(3):
            await resp.write(b"part%d;" % i)
        await resp.write_eof()
        return resp
    if request.path == "/ws":
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str(json.dumps({"x-key": request.headers.get("X-Key")}))
        async for msg in ws:
            await ws.send_str("echo:" + msg.data)
        return ws
    body = await request.read()
    peer = request.transport.get_extra_info("peername") if request.transport else None
    seen = {"method": request.method, "path": request.path_qs, "headers": list(request.headers.items()),
            "body_len": len(body), "body_sha": hashlib.sha256(body).hexdigest(), "peer_port": peer and peer[1],
            "chunked": request.headers.get("Transfer-Encoding", "").lower() == "chunked"}
    ups.seen.append(seen)
    return web.json_response(seen)


@pytest.fixture(scope="module")
async def upstream_ca() -> CA:
    return CA.create("test upstream CA")


@pytest.fixture(scope="module")
async def ups(upstream_ca: CA) -> AsyncIterator[Upstreams]:
    u = Upstreams()
    app = web.Application()
    app[UPS] = u
    app.router.add_route("*", "/{tail:.*}", echo)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    plain = web.TCPSite(runner, "127.0.0.1", 0)
    secure = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_server_context(upstream_ca, *NAMES))
    await plain.start()
    await secure.start()
    u.http, u.https = plain._server.sockets[0].getsockname()[1], secure._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def reverse(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        data = await r.read()
        w.write(data[::-1])
        await w.drain()
        w.close()

    async def banner(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"220 banner.test ready\r\n")
        line = await r.readline()
        w.write(b"you said " + line)
        await w.drain()
        w.close()

    servers = [await asyncio.start_server(reverse, "127.0.0.1", 0), await asyncio.start_server(banner, "127.0.0.1", 0)]
    u.reverse, u.banner = (s.sockets[0].getsockname()[1] for s in servers)
    yield u
    for s in servers:
        s.close()
    await runner.cleanup()


# --- the proxy under test --------------------------------------------------------------------------------------

@dataclass
class Env:
    proxy: Proxy
    ups: Upstreams
    egress_ca: CA
    upstream_ca: CA
    policies: dict[str, Policy] = field(default_factory=dict)
    targets: dict[str, tuple[str, int]] = field(default_factory=dict)
    hosts: list[tuple[str, str]] = field(default_factory=list)
    bytes: dict[str, list[int]] = field(default_factory=dict)
    next_ip: int = 2

    def sandbox(self, policy: Policy, port: int, ip: str = "127.0.0.1") -> str:
        """A fresh client address whose connections have `policy` and were going to ip:port."""
        self.next_ip += 1
        src = f"127.1.{self.next_ip // 250}.{self.next_ip % 250 + 1}"
        self.policies[src], self.targets[src] = policy, (ip, port)
        return src

    @property
    def port(self) -> int:
        return self.proxy.address[1]

    def session(self, src: str, **kw: Any) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(src, 0), **kw))


def original_dst_for(env_ref: list[Env]) -> Callable[[socket.socket], tuple[str, int]]:
    def original_dst(sock: socket.socket) -> tuple[str, int]:
        return env_ref[0].targets[sock.getpeername()[0]]
    return original_dst


@pytest.fixture(scope="module")
async def env(ups: Upstreams, upstream_ca: CA) -> AsyncIterator[Env]:
    egress_ca = CA.create("test egress CA")
    ref: list[Env] = []
    proxy = Proxy(lookup=lambda ip: ref[0].policies.get(ip), secret_value=secret_value, ca=egress_ca,
                  upstream_trust=trusting(upstream_ca), guard=lambda ip: ip != "127.0.0.1",
                  on_bytes=lambda ip, u, d: _add(ref[0].bytes, ip, u, d),
                  on_host=lambda ip, h: ref[0].hosts.append((ip, h)), original_dst=original_dst_for(ref))
    e = Env(proxy, ups, egress_ca, upstream_ca)
    ref.append(e)
    await proxy.start("127.0.0.1", 0)
    yield e
    await proxy.stop()
    assert not [t for t in asyncio.all_tasks() if not t.done() and _is_proxy_task(t)], "tasks outlived the proxy"


def _add(counts: dict[str, list[int]], ip: str, up: int, down: int) -> None:
    c = counts.setdefault(ip, [0, 0])
    c[0] += up
    c[1] += down


@pytest.fixture(autouse=True)
async def no_leaks(env: Env, caplog: pytest.LogCaptureFixture) -> AsyncIterator[None]:
    """After each test: every connection's task gone (polled: a close takes a few loop turns), no secret value in
    the proxy's log."""
    caplog.set_level(logging.DEBUG, logger="keepstate.egress")
    yield
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    while env.proxy.connections and loop.time() < deadline:
        await asyncio.sleep(0.02)
    assert env.proxy.connections == 0
    leftover = [t for t in asyncio.all_tasks() if not t.done() and _is_proxy_task(t)]
    assert [t.get_name() for t in leftover] == ["egress-proxy-accept"]
    for value in SECRETS.values():
        assert value not in caplog.text


def _is_proxy_task(t: asyncio.Task[Any]) -> bool:
    code = getattr(t.get_coro(), "cr_code", None)
    return code is not None and "keepstate/egress" in code.co_filename


def default(**network: Any) -> Policy:
    return parse(network)


# --- helpers ---------------------------------------------------------------------------------------------------

async def expect_reset(env: Env, src: str, payload: bytes = b"", tls_name: str | None = None) -> None:
    """The proxy refuses: the client sees a reset (or, for TLS, the handshake fails on it)."""
    ctx = trusting(env.egress_ca, env.upstream_ca) if tls_name else None
    with pytest.raises((ConnectionResetError, ssl.SSLError, asyncio.IncompleteReadError)):
        r, w = await asyncio.open_connection("127.0.0.1", env.port, local_addr=(src, 0), ssl=ctx,
                                             server_hostname=tls_name)
        try:
            w.write(payload)
            await w.drain()
            data = await r.read()
            raise AssertionError(f"expected a reset, got {data!r}")
        finally:
            w.close()


async def issuer(env: Env, src: str, name: str, ctx: ssl.SSLContext) -> str:
    """The common name of the issuer of the certificate a TLS client of `name` sees through the proxy."""
    _, w = await asyncio.open_connection("127.0.0.1", env.port, local_addr=(src, 0), ssl=ctx, server_hostname=name)
    try:
        cert = w.get_extra_info("peercert")
        return str(dict(x[0] for x in cert["issuer"])["commonName"])
    finally:
        w.close()


def headers_of(seen: dict[str, Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for k, v in seen["headers"]:
        out.setdefault(k.lower(), []).append(v)
    return out


def rule_policy(**extra: Any) -> Policy:
    return default(rules=RULES, **extra)


# --- header rules ----------------------------------------------------------------------------------------------

async def test_headers_injected_over_http_replacing_the_clients(env: Env) -> None:
    src = env.sandbox(rule_policy(), env.ups.http)
    async with env.session(src) as s:
        async with s.get(f"http://127.0.0.1:{env.port}/v1/x?q=1", headers={
                "Host": "api.rule.test", "authorization": "Bearer mine", "X-Client": "kept"}) as r:
            assert r.status == 200
            seen = await r.json()
    h = headers_of(seen)
    assert h["authorization"] == [f"Bearer {SECRETS['api_key']}"]
    assert h["x-static"] == ["fixed"] and h["x-client"] == ["kept"] and seen["path"] == "/v1/x?q=1"
    assert (src, "api.rule.test") in env.hosts
    up, down = env.bytes[src]
    assert up > 0 and down > 0


async def test_headers_injected_over_https_with_the_egress_ca(env: Env) -> None:
    src = env.sandbox(rule_policy(), env.ups.https)
    async with env.session(src) as s:
        # the client trusts only the egress CA: this succeeds only if the proxy terminated TLS
        async with s.get(f"https://127.0.0.1:{env.port}/secure", ssl=trusting(env.egress_ca),
                         server_hostname="api.rule.test", headers={"Host": "api.rule.test"}) as r:
            assert r.status == 200
            seen = await r.json()
    assert headers_of(seen)["authorization"] == [f"Bearer {SECRETS['api_key']}"]
    assert await issuer(env, src, "api.rule.test", trusting(env.egress_ca)) == "test egress CA"


async def test_a_missing_secret_is_a_502_naming_it_and_no_value(env: Env) -> None:
    src = env.sandbox(rule_policy(), env.ups.http)
    before = len(env.ups.seen)
    async with env.session(src) as s:
        async with s.get(f"http://127.0.0.1:{env.port}/", headers={"Host": "gone.rule.test"}) as r:
            assert r.status == 502
            body = await r.json()
            raw = json.dumps(body) + str(r.headers)
    assert body["code"] == 502 and "missing_one" in body["message"] and "X-Gone" in body["message"]
    for value in SECRETS.values():
        assert value not in raw
    assert len(env.ups.seen) == before  # nothing went upstream


async def test_plain_http_secrets_go_only_to_an_address_resolved_for_the_name(env: Env, ups: Upstreams,
                                                                             upstream_ca: CA) -> None:
    answers = {("127.1.253.1", "api.rule.test", "127.0.0.1")}
    proxy = Proxy(lookup=lambda ip: rule_policy(), secret_value=secrets_of(SECRETS), ca=env.egress_ca,
                  upstream_trust=trusting(upstream_ca), guard=lambda ip: ip != "127.0.0.1",
                  original_dst=lambda sock: ("127.0.0.1", ups.http), resolved=lambda *a: a in answers)
    await proxy.start("127.0.0.1", 0)
    url = f"http://127.0.0.1:{proxy.address[1]}/"
    try:
        async with env.session("127.1.253.1") as s:  # its resolver gave 127.0.0.1 for api.rule.test
            async with s.get(url, headers={"Host": "api.rule.test"}) as r:
                assert headers_of(await r.json())["authorization"] == [f"Bearer {SECRETS['api_key']}"]
        before = len(ups.seen)
        async with env.session("127.1.253.2") as s:  # claims the name for an address never resolved for it
            async with s.get(url, headers={"Host": "api.rule.test"}) as r:
                assert r.status == 502
                body = await r.text()
        assert "resolver" in body and SECRETS["api_key"] not in body and len(ups.seen) == before
    finally:
        await proxy.stop()


async def test_a_secret_holding_a_line_break_is_refused_not_injected(env: Env) -> None:
    src = env.sandbox(rule_policy(), env.ups.http)
    before = len(env.ups.seen)
    async with env.session(src) as s:
        async with s.get(f"http://127.0.0.1:{env.port}/", headers={"Host": "bad.rule.test"}) as r:
            assert r.status == 502
            body = await r.text()
    assert "broken" in body and "Injected" not in body and len(env.ups.seen) == before


async def test_a_secret_store_failure_is_a_502(env: Env) -> None:
    src = env.sandbox(rule_policy(), env.ups.http)
    async with env.session(src) as s:
        async with s.get(f"http://127.0.0.1:{env.port}/", headers={"Host": "err.rule.test"}) as r:
            assert r.status == 502
            assert "'explodes'" in (await r.json())["message"]


async def test_keep_alive_two_requests_on_one_connection_both_rewritten(env: Env) -> None:
    src = env.sandbox(rule_policy(), env.ups.https)
    seen, ctx = [], trusting(env.egress_ca)
    async with env.session(src, limit=1) as s:
        for i in range(2):
            async with s.post(f"https://127.0.0.1:{env.port}/n/{i}", data=b"x" * (i + 1) * 1000, ssl=ctx,
                              server_hostname="api.rule.test",
                              headers={"Host": "api.rule.test", "Authorization": "nope"}) as r:
                seen.append(await r.json())
    assert [headers_of(x)["authorization"] for x in seen] == [[f"Bearer {SECRETS['api_key']}"]] * 2
    assert [x["body_len"] for x in seen] == [1000, 2000]
    assert seen[0]["peer_port"] == seen[1]["peer_port"]  # one upstream connection
    assert [h for h in env.hosts if h[0] == src] == [(src, "api.rule.test")]  # one proxied connection


async def test_a_chunked_response_then_another_request_on_one_connection(env: Env) -> None:
    src = env.sandbox(rule_policy(), env.ups.https)
    async with env.session(src, limit=1) as s:
        kw: dict[str, Any] = {"ssl": trusting(env.egress_ca), "server_hostname": "api.rule.test",
                              "headers": {"Host": "api.rule.test"}}
        async with s.get(f"https://127.0.0.1:{env.port}/chunked", **kw) as r:
            assert r.headers["Transfer-Encoding"] == "chunked" and await r.read() == b"part0;part1;part2;"
        async with s.get(f"https://127.0.0.1:{env.port}/after", **kw) as r:
            seen = await r.json()
    assert headers_of(seen)["authorization"] == [f"Bearer {SECRETS['api_key']}"]
    assert [h for h in env.hosts if h[0] == src] == [(src, "api.rule.test")]  # one client connection


async def test_expect_100_continue_is_answered_before_the_body_is_sent(env: Env) -> None:
    src = env.sandbox(rule_policy(), env.ups.https)
    r, w = await asyncio.open_connection("127.0.0.1", env.port, local_addr=(src, 0), ssl=trusting(env.egress_ca),
                                         server_hostname="api.rule.test")
    try:
        w.write(b"POST /e HTTP/1.1\r\nHost: api.rule.test\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        assert (await r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100")  # the upstream's, through the proxy
        w.write(b"hello")
        head = await r.readuntil(b"\r\n\r\n")
        length = int(next(x.split(b":")[1] for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")))
        seen = json.loads(await r.readexactly(length))
    finally:
        w.close()
    assert head.startswith(b"HTTP/1.1 200") and seen["body_len"] == 5
    assert headers_of(seen)["authorization"] == [f"Bearer {SECRETS['api_key']}"]


async def test_chunked_upload_through_a_rule_host(env: Env) -> None:
    src = env.sandbox(rule_policy(), env.ups.http)
    parts = [bytes([i]) * (1000 + i * 37) for i in range(40)]

    async def body() -> AsyncIterator[bytes]:
        for p in parts:
            yield p

    async with env.session(src) as s:
        async with s.post(f"http://127.0.0.1:{env.port}/upload", data=body(),
                          headers={"Host": "api.rule.test"}) as r:
            seen = await r.json()
    assert seen["chunked"] and seen["body_len"] == sum(map(len, parts))
    assert seen["body_sha"] == hashlib.sha256(b"".join(parts)).hexdigest()
    assert headers_of(seen)["authorization"] == [f"Bearer {SECRETS['api_key']}"]


async def test_websocket_upgrade_rewritten_then_spliced(env: Env) -> None:
    src = env.sandbox(rule_policy(), env.ups.http)
    async with env.session(src) as s:
        async with s.ws_connect(f"http://127.0.0.1:{env.port}/ws", headers={"Host": "ws.rule.test"}) as ws:
            first = json.loads((await ws.receive()).data)
            await ws.send_str("hello")
            assert (await ws.receive()).data == "echo:hello"
    assert first == {"x-key": SECRETS["other"]}


async def test_a_slow_head_keeps_its_rules(env: Env) -> None:
    """A client that sends its request head in pieces, slower than the proxy's wait for a first byte."""
    src = env.sandbox(rule_policy(), env.ups.http)
    r, w = await asyncio.open_connection("127.0.0.1", env.port, local_addr=(src, 0))
    for piece in (b"GET /slow HTTP/1.1\r\nHo", b"st: api.rule.test\r\nConnection: close\r\n", b"\r\n"):
        w.write(piece)
        await w.drain()
        await asyncio.sleep(0.4)  # deliberately slower than PEEK_S: the scenario, not a wait for a condition
    response = await r.read()
    w.close()
    seen = json.loads(response.split(b"\r\n\r\n", 1)[1])
    assert headers_of(seen)["authorization"] == [f"Bearer {SECRETS['api_key']}"]


async def test_a_fragmented_client_hello_in_two_segments_is_intercepted(env: Env) -> None:
    """A ClientHello split into 100-byte records, sent as two TCP writes apart: the peek waits for the rest."""
    src = env.sandbox(rule_policy(), env.ups.https)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = trusting(env.egress_ca).wrap_bio(incoming, outgoing, server_hostname="api.rule.test")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = outgoing.read()
    body = hello[5:]
    records = b"".join(hello[:3] + len(body[i:i + 100]).to_bytes(2, "big") + body[i:i + 100]
                       for i in range(0, len(body), 100))
    r, w = await asyncio.open_connection("127.0.0.1", env.port, local_addr=(src, 0))
    w.write(records[:150])
    await w.drain()
    await asyncio.sleep(0.4)  # deliberately slower than PEEK_S
    w.write(records[150:])
    await w.drain()

    async def pump_tls() -> None:
        if out := outgoing.read():
            w.write(out)
            await w.drain()
        data = await r.read(65536)
        assert data, "the proxy closed during the handshake"
        incoming.write(data)

    while True:
        try:
            tls.do_handshake()
            break
        except ssl.SSLWantReadError:
            await pump_tls()
    tls.write(b"GET /frag HTTP/1.1\r\nHost: api.rule.test\r\nConnection: close\r\n\r\n")
    response = b""
    while True:
        try:
            chunk = tls.read(65536)
        except ssl.SSLWantReadError:
            await pump_tls()
            continue
        except ssl.SSLZeroReturnError:
            break
        if not chunk:
            break
        response += chunk
        if b"\r\n\r\n" in response:
            head, _, rest = response.partition(b"\r\n\r\n")
            length = int(next(x.split(b":")[1] for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")))
            if len(rest) >= length:
                break
    w.close()
    seen = json.loads(response.partition(b"\r\n\r\n")[2])
    assert headers_of(seen)["authorization"] == [f"Bearer {SECRETS['api_key']}"]
    assert tls.getpeercert()["issuer"][0][0][1] == "test egress CA"


# --- names: SNI and Host ---------------------------------------------------------------------------------------

def named() -> Policy:
    return default(allowOut=["*.allowed.test"], denyOut=["0.0.0.0/0"])


async def test_sni_allows_a_matching_name_and_resets_another(env: Env) -> None:
    assert named().ip_verdict("127.0.0.1") == "name"
    src = env.sandbox(named(), env.ups.https)
    async with env.session(src) as s:
        async with s.get(f"https://127.0.0.1:{env.port}/", ssl=trusting(env.upstream_ca),
                         server_hostname="api.allowed.test", headers={"Host": "api.allowed.test"}) as r:
            assert r.status == 200
    await expect_reset(env, src, tls_name="other.test")
    await expect_reset(env, src, tls_name="allowed.test")  # "*." names subdomains only


async def test_host_allows_a_matching_name_over_http_and_resets_another(env: Env) -> None:
    src = env.sandbox(named(), env.ups.http)
    async with env.session(src) as s:
        async with s.get(f"http://127.0.0.1:{env.port}/", headers={"Host": "www.allowed.test"}) as r:
            assert r.status == 200
    await expect_reset(env, src, b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n")
    await expect_reset(env, src, b"\x00opaque bytes name nothing")


async def test_a_denied_address_is_reset_whatever_the_name(env: Env) -> None:
    src = env.sandbox(default(denyOut=["127.0.0.0/8"]), env.ups.http)
    await expect_reset(env, src, b"GET / HTTP/1.1\r\nHost: www.allowed.test\r\n\r\n")


# --- splicing untouched ----------------------------------------------------------------------------------------

async def test_a_non_rule_https_host_is_spliced_with_the_upstreams_certificate(env: Env) -> None:
    src = env.sandbox(rule_policy(), env.ups.https)
    async with env.session(src) as s:
        async with s.get(f"https://127.0.0.1:{env.port}/p", ssl=trusting(env.upstream_ca),
                         server_hostname="plain.test", headers={"Host": "plain.test",
                                                                "Authorization": "mine"}) as r:
            seen = await r.json()
    assert await issuer(env, src, "plain.test", trusting(env.upstream_ca)) == "test upstream CA"
    assert headers_of(seen)["authorization"] == ["mine"]


async def test_opaque_bytes_pass_both_ways_with_half_close(env: Env) -> None:
    src = env.sandbox(rule_policy(), env.ups.reverse)
    payload = b"\x00\x01 not http, not tls \xff" * 1000
    r, w = await asyncio.open_connection("127.0.0.1", env.port, local_addr=(src, 0))
    w.write(payload)
    w.write_eof()
    assert await r.read() == payload[::-1]
    w.close()
    assert env.bytes[src] == [len(payload), len(payload)]


async def test_a_server_that_speaks_first(env: Env) -> None:
    src = env.sandbox(default(), env.ups.banner)
    r, w = await asyncio.open_connection("127.0.0.1", env.port, local_addr=(src, 0))
    assert await r.readline() == b"220 banner.test ready\r\n"  # after the proxy's peek gave up waiting
    w.write(b"hi\r\n")
    assert await r.read() == b"you said hi\r\n"
    w.close()


# --- refusals --------------------------------------------------------------------------------------------------

async def test_a_guarded_destination_is_reset_and_never_dialed(env: Env) -> None:
    accepted: list[int] = []

    async def count(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        accepted.append(1)
        w.close()

    server = await asyncio.start_server(count, "127.0.0.2", 0)
    try:
        src = env.sandbox(default(), server.sockets[0].getsockname()[1], ip="127.0.0.2")
        await expect_reset(env, src, b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n")
    finally:
        server.close()
    assert accepted == []


async def test_an_unknown_source_is_reset(env: Env) -> None:
    await expect_reset(env, "127.1.250.250", b"GET / HTTP/1.1\r\n\r\n")


# --- SOCKS5 upstream -------------------------------------------------------------------------------------------

async def test_through_socks5_with_credentials(env: Env) -> None:
    log: list[dict[str, Any]] = []
    server = await serve_socks("127.0.0.1", 0, ("user", "pass-word"), {}, log)
    socks_port = server.sockets[0].getsockname()[1]
    try:
        policy = rule_policy(egressProxy={"address": f"127.0.0.1:{socks_port}", "username": "user",
                                          "password": "pass-word"})
        src = env.sandbox(policy, env.ups.https)
        async with env.session(src) as s:
            async with s.get(f"https://127.0.0.1:{env.port}/via", ssl=trusting(env.egress_ca),
                             server_hostname="api.rule.test", headers={"Host": "api.rule.test"}) as r:
                seen = await r.json()
        assert headers_of(seen)["authorization"] == [f"Bearer {SECRETS['api_key']}"]
        # the original address, never a name for the upstream to resolve
        assert [(e["target"], e["atyp"], e["user"], e["result"]) for e in log] == [
            (f"127.0.0.1:{env.ups.https}", "ipv4", "user", "ok")]
        bad = env.sandbox(rule_policy(egressProxy={"address": f"127.0.0.1:{socks_port}", "username": "user",
                                                   "password": "wrong"}), env.ups.http)
        await expect_reset(env, bad, b"GET / HTTP/1.1\r\nHost: plain.test\r\n\r\n")
        assert log[-1]["result"] == "bad credentials"
    finally:
        server.close()


async def test_socks5_down_fails_closed(env: Env) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]  # bound, never listening: connections to it are refused
        before = len(env.ups.seen)
        src = env.sandbox(default(egressProxy={"address": f"127.0.0.1:{closed_port}"}), env.ups.http)
        await expect_reset(env, src, b"GET / HTTP/1.1\r\nHost: plain.test\r\n\r\n")
    assert len(env.ups.seen) == before  # not sent direct


async def test_a_socks5_proxy_in_the_guarded_set_is_never_dialed(env: Env) -> None:
    src = env.sandbox(default(egressProxy={"address": "127.0.0.9:1080"}), env.ups.http)
    await expect_reset(env, src, b"GET / HTTP/1.1\r\nHost: plain.test\r\n\r\n")


# --- scale -----------------------------------------------------------------------------------------------------

async def test_200_concurrent_connections(env: Env) -> None:
    http_src = env.sandbox(rule_policy(), env.ups.http)
    tls_src = env.sandbox(rule_policy(), env.ups.https)
    egress_ctx = trusting(env.egress_ca)

    async def one(i: int) -> dict[str, Any]:
        tls = i % 2 == 1
        async with env.session(tls_src if tls else http_src, force_close=True) as s:
            async with s.post(f"{'https' if tls else 'http'}://127.0.0.1:{env.port}/c/{i}", data=str(i).encode(),
                              ssl=egress_ctx if tls else None, server_hostname="api.rule.test" if tls else None,
                              headers={"Host": "api.rule.test"}) as r:
                assert r.status == 200
                return await r.json()

    results = await asyncio.gather(*(one(i) for i in range(200)))
    assert sorted(r["path"] for r in results) == sorted(f"/c/{i}" for i in range(200))
    assert all(headers_of(r)["authorization"] == [f"Bearer {SECRETS['api_key']}"] for r in results)


async def test_stop_resets_open_connections_and_leaves_no_task(env: Env, ups: Upstreams, upstream_ca: CA) -> None:
    policy = rule_policy()
    targets = {"127.1.251.1": ("127.0.0.1", ups.reverse), "127.1.251.2": ("127.0.0.1", ups.https)}
    proxy = Proxy(lookup=lambda ip: policy, secret_value=secrets_of(SECRETS), ca=env.egress_ca,
                  upstream_trust=trusting(upstream_ca), guard=lambda ip: ip != "127.0.0.1",
                  original_dst=lambda sock: targets[sock.getpeername()[0]])
    others = {t for t in asyncio.all_tasks() if _is_proxy_task(t)}  # the module's proxy
    await proxy.start("127.0.0.1", 0)
    port = proxy.address[1]
    r1, w1 = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.1.251.1", 0))
    w1.write(b"\x00spliced, waiting")
    await w1.drain()
    r2, w2 = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.1.251.2", 0),
                                           ssl=trusting(env.egress_ca), server_hostname="api.rule.test")
    w2.write(b"POST /p HTTP/1.1\r\nHost: api.rule.test\r\nContent-Length: 100\r\n\r\nhalf a body")
    await w2.drain()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while proxy.connections < 2 and loop.time() < deadline:
        await asyncio.sleep(0.02)
    before = {t for t in asyncio.all_tasks() if _is_proxy_task(t)} - others
    assert proxy.connections == 2 and len(before) >= 3  # the accept loop, two connections, their pumps
    await proxy.stop()
    with pytest.raises(ConnectionResetError):
        await r1.read()
    with pytest.raises((ConnectionResetError, ssl.SSLError, asyncio.IncompleteReadError)):
        await r2.readexactly(1)
    w1.close()
    w2.close()
    assert proxy.connections == 0
    assert all(t.done() for t in before), [t for t in before if not t.done()]


async def test_a_sandbox_over_its_connection_limit_is_reset(env: Env, ups: Upstreams, upstream_ca: CA) -> None:
    proxy = Proxy(lookup=lambda ip: default(), secret_value=secrets_of(SECRETS), ca=env.egress_ca,
                  upstream_trust=trusting(upstream_ca), guard=lambda ip: ip != "127.0.0.1",
                  original_dst=lambda sock: ("127.0.0.1", ups.reverse), max_connections=2)
    await proxy.start("127.0.0.1", 0)
    port = proxy.address[1]
    try:
        held = [await asyncio.open_connection("127.0.0.1", port, local_addr=("127.1.252.1", 0)) for _ in range(2)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while proxy.connections < 2 and loop.time() < deadline:
            await asyncio.sleep(0.02)
        r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.1.252.1", 0))
        with pytest.raises(ConnectionResetError):
            await r.read()
        w.close()
        other = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.1.252.2", 0))  # another sandbox
        other[1].write(b"\x00ok")
        other[1].write_eof()
        assert await other[0].read() == b"ko\x00"
        other[1].close()
        for hr, hw in held:
            hw.write_eof()
            assert await hr.read() == b""
            hw.close()
    finally:
        await proxy.stop()


async def test_cut_resets_a_sandboxs_open_connections(env: Env) -> None:
    src = env.sandbox(default(), env.ups.reverse)
    r, w = await asyncio.open_connection("127.0.0.1", env.port, local_addr=(src, 0))
    w.write(b"\x00waiting")
    await w.drain()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while env.proxy.cut(src) == 0 and loop.time() < deadline:
        await asyncio.sleep(0.02)
    with pytest.raises(ConnectionResetError):
        await r.read()
    with contextlib.suppress(OSError):
        w.close()
