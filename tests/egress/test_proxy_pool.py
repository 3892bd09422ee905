"""The egress proxy's upstream pool, against the fake internet's web site (keepstate.testing.internet_http) on
loopback: it numbers its connections (`connection` in /echo, `Site.connections`) and has routes that end a
connection each way a server can (close-delimited, `Connection: close`, closed after a keep-alive response, closed
on the next request).

Each test's "sandbox" is a fresh client address (127.2.0.N) with its own Policy object, as in test_proxy.py; the
clients make a new connection per request and say `Connection: close`, as benchmarks/network.py's does.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from keepstate.egress.ca import CA
from keepstate.egress.pipe import Side
from keepstate.egress.policy import Policy, parse
from keepstate.egress.pool import Key, Upstream, UpstreamConnections, Watched
from keepstate.egress.proxy import Proxy
from keepstate.testing.internet_http import Site, serve_site, tls_context

from .test_proxy import secrets_of

NAME = "pool.test"
SECRET = "pool-secret-VALUE-93"


def rules() -> Policy:
    """A new Policy object each call: what the service makes for each sandbox and for each update."""
    return parse({"rules": {NAME: [{"transform": {"headers": {"X-Pool": "${e2b.secrets.k}"}}}]}})


@dataclass
class Env:
    proxy: Proxy
    site: Site
    ports: dict[str, int]  # "http", "https" → the site's port
    egress_ca: CA
    policies: dict[str, Policy] = field(default_factory=dict)
    targets: dict[str, int] = field(default_factory=dict)
    next_ip: int = 1

    def sandbox(self, scheme: str = "https", policy: Policy | None = None) -> str:
        self.next_ip += 1
        src = f"127.2.{self.next_ip // 250}.{self.next_ip % 250 + 1}"
        self.policies[src], self.targets[src] = policy or rules(), self.ports[scheme]
        return src


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def parse_reply(data: bytes) -> Reply:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return Reply(int(lines[0].split()[1]), headers, body)


async def open_client(env: Env, src: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    tls = env.targets[src] == env.ports["https"]
    ctx = None
    if tls:
        ctx = ssl.create_default_context(cadata=env.egress_ca.cert_pem.decode())  # only the proxy's leaf passes
    return await asyncio.open_connection("127.0.0.1", env.proxy.address[1], local_addr=(src, 0), ssl=ctx,
                                         server_hostname=NAME if tls else None)


async def request(env: Env, src: str, path: str = "/echo", method: str = "GET", body: bytes = b"") -> Reply:
    """One request on a new connection with `Connection: close`, read to the proxy's close."""
    r, w = await open_client(env, src)
    try:
        extra = f"Content-Length: {len(body)}\r\n" if body else ""
        w.write(f"{method} {path} HTTP/1.1\r\nHost: {NAME}\r\n{extra}Connection: close\r\n\r\n".encode() + body)
        await w.drain()
        async with asyncio.timeout(30):  # a hang guard, not a measurement
            return parse_reply(await r.read())
    finally:
        w.close()


async def wait_for(condition: Any, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    while not condition():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
async def site() -> AsyncIterator[tuple[Site, dict[str, int]]]:
    ca = CA.create("pool test upstream CA")
    cert, key = ca.issue(NAME)
    with tempfile.TemporaryDirectory() as d:
        s = Site("127.0.0.1", NAME)
        servers = [await serve_site(s, 0), await serve_site(s, 0, tls_context(cert, key, d))]
    ports = {"http": servers[0].sockets[0].getsockname()[1], "https": servers[1].sockets[0].getsockname()[1]}
    s.extra["ca"] = lambda: ca.cert_pem.decode()
    yield s, ports
    for server in servers:
        server.close()


def make_proxy(env_ref: list[Env], ca_pem: str, egress_ca: CA, pool: UpstreamConnections | None = None) -> Proxy:
    return Proxy(lookup=lambda ip: env_ref[0].policies.get(ip), secret_value=secrets_of({"k": SECRET}), ca=egress_ca,
                 upstream_trust=ssl.create_default_context(cadata=ca_pem), guard=lambda ip: ip != "127.0.0.1",
                 original_dst=lambda sock: ("127.0.0.1", env_ref[0].targets[sock.getpeername()[0]]), pool=pool)


@pytest.fixture
async def env(site: tuple[Site, dict[str, int]]) -> AsyncIterator[Env]:
    s, ports = site
    egress_ca = CA.create("pool test egress CA")
    ref: list[Env] = []
    proxy = make_proxy(ref, str(s.extra["ca"]()), egress_ca)
    e = Env(proxy, s, ports, egress_ca)
    ref.append(e)
    await proxy.start("127.0.0.1", 0)
    yield e
    await wait_for(lambda: proxy.connections == 0, "a connection's task outlived it")
    await proxy.stop()
    assert proxy.pool.idle() == 0


# --- reuse ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["https", "http"])
async def test_two_connections_of_a_sandbox_one_after_the_other_share_one_upstream_connection(
        env: Env, scheme: str) -> None:
    src = env.sandbox(scheme)
    before = env.site.connections
    first, second = await request(env, src), await request(env, src)
    assert first.status == second.status == 200
    assert first.json()["connection"] == second.json()["connection"]
    assert env.site.connections == before + 1
    for reply in (first, second):
        seen = reply.json()
        assert seen["headers"]["x-pool"] == SECRET  # rules still set on a kept connection
        assert "close" not in seen["headers"].get("connection", "")  # the client's close is not sent upstream
        assert reply.headers["connection"] == "close"  # but the client is told its connection ends


async def test_a_keep_alive_client_connection_and_the_next_one_share_it(env: Env) -> None:
    src = env.sandbox()
    r, w = await open_client(env, src)
    seen = []
    for _ in range(2):
        w.write(f"GET /echo HTTP/1.1\r\nHost: {NAME}\r\n\r\n".encode())
        head = await r.readuntil(b"\r\n\r\n")
        reply = parse_reply(head)
        assert reply.status == 200 and reply.headers["connection"] == "keep-alive"
        seen.append(json.loads(await r.readexactly(int(reply.headers["content-length"]))))
    w.write(f"HEAD / HTTP/1.1\r\nHost: {NAME}\r\n\r\n".encode())  # a length and no body: the connection goes on
    assert parse_reply(await r.readuntil(b"\r\n\r\n")).headers["content-length"] == str(len(f"site {NAME}"))
    w.write(f"GET /echo HTTP/1.1\r\nHost: {NAME}\r\n\r\n".encode())
    seen.append(parse_reply(await r.readuntil(b"\r\n\r\n")).headers)
    await r.readexactly(int(seen[-1]["content-length"]))
    w.close()
    last = (await request(env, src)).json()
    assert seen[0]["connection"] == seen[1]["connection"] == last["connection"]


async def test_two_sandboxes_never_share_an_upstream_connection(env: Env) -> None:
    shared = rules()  # even with one Policy object between them
    a, b = env.sandbox(policy=shared), env.sandbox(policy=shared)
    a1 = (await request(env, a)).json()["connection"]
    b1 = (await request(env, b)).json()["connection"]
    a2 = (await request(env, a)).json()["connection"]
    b2 = (await request(env, b)).json()["connection"]
    assert a1 == a2 and b1 == b2 and a1 != b1


# --- what is not reused ---------------------------------------------------------------------------------------

async def test_a_connection_its_server_closed_is_not_reused(env: Env) -> None:
    src = env.sandbox()
    dropped = await request(env, src, "/drop")  # says keep-alive, then the server closes
    assert dropped.status == 200 and dropped.body.startswith(b"drop ")
    number = int(dropped.body.split()[-1])
    await wait_for(lambda: env.proxy.pool.idle(src) == 0, "the closed connection stayed in the pool")
    assert (await request(env, src)).json()["connection"] != number


async def test_a_close_delimited_response_is_relayed_whole_and_not_reused(env: Env) -> None:
    src = env.sandbox()
    reply = await request(env, src, "/close-delimited")
    assert reply.status == 200 and reply.body == f"close-delimited {NAME} {reply.body.split()[-1].decode()}".encode()
    assert "content-length" not in reply.headers
    assert (await request(env, src)).json()["connection"] != int(reply.body.split()[-1])


async def test_a_response_that_says_close_is_not_reused(env: Env) -> None:
    src = env.sandbox()
    reply = await request(env, src, "/bye")
    assert reply.status == 200 and reply.headers["connection"] == "close"
    assert env.proxy.pool.idle(src) == 0
    assert (await request(env, src)).json()["connection"] != int(reply.body.split()[-1])


async def test_a_request_that_meets_a_kept_connection_closing_is_sent_again_once_without_a_body(env: Env) -> None:
    """/hang-up's connection reads the next request and closes without an answer: the keep-alive race."""
    src = env.sandbox()
    first = int((await request(env, src, "/hang-up")).body.split()[-1])
    again = await request(env, src)
    assert again.status == 200 and again.json()["connection"] != first
    second = int((await request(env, src, "/hang-up")).body.split()[-1])
    before = env.site.connections
    posted = await request(env, src, "/echo", "POST", b"once")  # not idempotent, has a body: never sent twice
    assert posted.status == 502 and "before answering" in posted.json()["message"]
    assert env.site.connections == before and second != first


async def test_a_sandboxs_policy_update_or_forget_drops_its_kept_connections(env: Env) -> None:
    src = env.sandbox()
    first = (await request(env, src)).json()["connection"]
    env.policies[src] = rules()  # an update: another Policy object
    second = (await request(env, src)).json()["connection"]
    assert second != first
    assert env.proxy.pool.idle(src) == 1
    await asyncio.to_thread(env.proxy.forget, src)  # as the egress service calls it, from a thread
    await wait_for(lambda: env.proxy.pool.idle(src) == 0, "forget left the connection in the pool")
    assert (await request(env, src)).json()["connection"] not in (first, second)


async def test_a_keep_alive_client_connection_ends_when_its_upstream_does(env: Env) -> None:
    src = env.sandbox()
    r, w = await open_client(env, src)
    w.write(f"GET /drop HTTP/1.1\r\nHost: {NAME}\r\n\r\n".encode())
    reply = parse_reply(await r.readuntil(b"\r\n\r\n"))
    assert reply.headers["connection"] == "keep-alive"
    await r.readexactly(int(reply.headers["content-length"]))
    async with asyncio.timeout(30):  # a hang guard
        assert await r.read() == b""  # closed, as the server's own close would be seen
    w.close()


# --- bounds -----------------------------------------------------------------------------------------------------

async def own_proxy(site: tuple[Site, dict[str, int]], pool: UpstreamConnections) -> Env:
    s, ports = site
    ref: list[Env] = []
    egress_ca = CA.create("pool test egress CA")
    e = Env(make_proxy(ref, str(s.extra["ca"]()), egress_ca, pool), s, ports, egress_ca)
    ref.append(e)
    await e.proxy.start("127.0.0.1", 0)
    return e


async def test_idle_connections_per_key_are_bounded(site: tuple[Site, dict[str, int]]) -> None:
    e = await own_proxy(site, UpstreamConnections(per_key=2))
    try:
        src = e.sandbox()
        clients = [await open_client(e, src) for _ in range(3)]  # three at once: three upstream connections
        for _, w in clients:
            w.write(f"GET /echo HTTP/1.1\r\nHost: {NAME}\r\nConnection: close\r\n\r\n".encode())
        numbers = {parse_reply(await r.read()).json()["connection"] for r, _ in clients}
        for _, w in clients:
            w.close()
        assert len(numbers) == 3
        await wait_for(lambda: e.proxy.connections == 0, "connections outlived their clients")
        assert e.proxy.pool.idle(src) == 2
    finally:
        await e.proxy.stop()
    assert e.proxy.pool.idle() == 0


async def test_an_idle_connection_times_out(site: tuple[Site, dict[str, int]]) -> None:
    e = await own_proxy(site, UpstreamConnections(idle_s=0.2))
    try:
        src = e.sandbox()
        first = (await request(e, src)).json()["connection"]
        await wait_for(lambda: e.proxy.pool.idle(src) == 0, "an idle connection outlived its idle timeout")
        assert (await request(e, src)).json()["connection"] != first
    finally:
        await e.proxy.stop()


# --- the pool itself ----------------------------------------------------------------------------------------------

async def raw_upstream(port: int) -> Upstream:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(loop=loop)
    protocol = Watched(reader, loop)
    transport, _ = await loop.create_connection(lambda: protocol, "127.0.0.1", port)
    return Upstream(Side(reader, asyncio.StreamWriter(transport, protocol, reader, loop)), protocol)


async def test_the_pool_drops_an_idle_connection_its_upstream_closes_and_one_with_unread_bytes() -> None:
    ends: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda r, w: ends.append(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool, policy = UpstreamConnections(), rules()
    key = Key("127.2.255.1", "127.0.0.1", port, None, None)
    try:
        conn = await raw_upstream(port)
        await wait_for(lambda: len(ends) == 1, "the server did not accept")
        assert pool.put(key, policy, conn) and pool.idle("127.2.255.1") == 1
        ends[0].close()  # the upstream closes while the connection sits idle
        await wait_for(lambda: pool.idle() == 0, "a connection its upstream closed stayed in the pool")
        assert pool.take(key, policy) is None

        chatty = await raw_upstream(port)
        await wait_for(lambda: len(ends) == 2, "the server did not accept")
        ends[1].write(b"HTTP/1.1 200 OK\r\n")  # bytes no request asked for
        await wait_for(lambda: chatty.protocol.received > 0, "no byte arrived")
        assert not pool.put(key, policy, chatty) and pool.idle() == 0

        kept = await raw_upstream(port)
        assert pool.put(key, policy, kept)
        assert pool.take(key, rules()) is None  # another Policy object: not handed out, closed
        assert pool.idle() == 0 and kept.side.writer.transport.is_closing()
    finally:
        for w in ends:
            w.close()
        server.close()
