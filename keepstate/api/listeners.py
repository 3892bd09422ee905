"""The server's listeners: the plain one, and the router's TLS one (`serve --tls-listen`), serving the same routes.

Port URLs are `<port>-<sandboxID>.<domain>` and the SDKs speak HTTPS to them, so the router offers TLS: with the
operator's certificate (`--tls-cert/--tls-key`, e.g. a wildcard for `*.<domain>`), or, for development, with leaves
its own CA issues per SNI name on demand (`--tls-self-signed`: `<home>/tls/router-ca.pem`, which
`keepstate tls trust` prints and installs). A wildcard certificate cannot cover `*.localhost` (browsers refuse
wildcards on a one-label suffix), hence one leaf per host name.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from aiohttp.web_runner import GracefulExit

from keepstate.egress.ca import CA

ROUTER_CA = "router"
TLS_PORT = 3443


def router_ca(home: Path) -> CA:
    """The router's own CA (`<home>/tls/router-ca.pem`), made on first use."""
    return CA.load_or_create(home / "tls", ROUTER_CA)


def domain_host(domain: str) -> str:
    """`localhost:3443` → `localhost`; `[::1]:3443` → `::1`."""
    d = domain.strip().lower()
    if d.startswith("[") and "]" in d:
        return d[1:d.index("]")]
    host, sep, port = d.rpartition(":")
    return host if sep and port.isdigit() and ":" not in host else d


def default_domain(port: int) -> str:
    """`localhost:<port>`: browsers, curl and systemd-resolved resolve every `*.localhost` name to loopback."""
    return f"localhost:{port}"


def self_signed_context(ca: CA, domain: str) -> ssl.SSLContext:
    """A server context that presents, for each SNI name under the domain, a leaf for exactly that name (issued on
    the first handshake, then cached by the CA); a handshake without SNI (an IP address) or for a name outside the
    domain gets the default leaf (the domain's host, 127.0.0.1, ::1)."""
    top = domain_host(domain)
    cert, key = ca.issue(top, "127.0.0.1", "::1")
    ctx = _context(cert + ca.cert_pem, key)

    def pick(sslobj: ssl.SSLObject, name: str | None, _: ssl.SSLContext) -> None:
        if name:
            name = name.lower().rstrip(".")
            if name == top or name.endswith("." + top):
                sslobj.context = ca.server_context(name)

    ctx.sni_callback = pick
    return ctx


def operator_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """A server context with the operator's certificate chain and key (read once, at start)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.set_alpn_protocols(["http/1.1"])
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the TLS certificate {cert_file} with key {key_file}: {exc}") from None
    return ctx


def _context(cert: bytes, key: bytes) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.set_alpn_protocols(["http/1.1"])
    with tempfile.TemporaryDirectory() as d:  # load_cert_chain reads files only
        (Path(d) / "c.pem").write_bytes(cert)
        (Path(d) / "k.pem").write_bytes(key)
        ctx.load_cert_chain(Path(d) / "c.pem", Path(d) / "k.pem")
    return ctx


@dataclass(frozen=True)
class Listener:
    host: str
    port: int
    ssl_context: ssl.SSLContext | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://{self.host}:{self.port}"


def plan(home: Path, host: str, port: int, domain: str | None, tls_cert: str | None, tls_key: str | None,
         self_signed: bool, tls_listen: str | None) -> tuple[list[Listener], str]:
    """`serve`'s listeners and domain from its options (ValueError: options that do not go together). TLS, when
    on, listens on `tls_listen` (default `<host>:3443`) and the default domain names that port."""
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if tls_cert and self_signed:
        raise ValueError("--tls-self-signed or --tls-cert/--tls-key, not both")
    tls_on = bool(tls_cert or self_signed)
    if tls_listen and not tls_on:
        raise ValueError("--tls-listen needs --tls-cert/--tls-key or --tls-self-signed")
    tls_host, _, tls_port = (tls_listen or f"{host}:{TLS_PORT}").rpartition(":")
    if not tls_port.isdigit() or not 0 < int(tls_port) < 65536:
        raise ValueError(f"--tls-listen {tls_listen!r} is not HOST:PORT")
    domain = (domain or "").strip().lower() or default_domain(int(tls_port) if tls_on else port)
    if any(c in domain for c in "/ @") or domain.startswith("."):
        raise ValueError(f"--domain {domain!r} must be a host name with an optional :PORT (no scheme, no path)")
    sites = [Listener(host, port)]
    if tls_on:
        ctx = (operator_context(Path(tls_cert), Path(tls_key)) if tls_cert and tls_key
               else self_signed_context(router_ca(home), domain))
        sites.append(Listener(tls_host or host, int(tls_port), ctx))
    return sites, domain


DEFER_ACCEPT = 1  # seconds the kernel holds a new connection that has sent nothing yet (TCP_DEFER_ACCEPT)


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound sockets for (host, port), one per address it resolves to, as `loop.create_server` binds them, plus
    TCP_DEFER_ACCEPT: a new connection wakes the server once, when its request has come, instead of once when
    the handshake ends and again for the request (every client speaks first here: HTTP, TLS). That is one sleep
    and wake-up of the loop less per connection, about 0.15 ms of what the router adds to a new connection's
    request on a busy 2-vCPU host (benchmarks/network.py)."""
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(
                socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, DEFER_ACCEPT)
            sock.bind(address)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def run(app: web.Application, listeners: list[Listener], **server_args: object) -> None:
    """`web.run_app` with several listeners (it takes one TLS setting for all): serve until SIGINT or SIGTERM,
    then shut down as it does."""

    async def main() -> None:
        runner = web.AppRunner(app, handle_signals=True, **server_args)  # type: ignore[arg-type]
        await runner.setup()
        try:
            for listener in listeners:
                for sock in listening_sockets(listener.host, listener.port):
                    await web.SockSite(runner, sock, ssl_context=listener.ssl_context).start()
            while True:
                await asyncio.sleep(3600)
        finally:
            await runner.cleanup()

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    task = loop.create_task(main())
    try:
        loop.run_until_complete(task)
    except (GracefulExit, KeyboardInterrupt):
        pass
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(task)
        for t in asyncio.all_tasks(loop):
            t.cancel()
        loop.run_until_complete(asyncio.gather(*asyncio.all_tasks(loop), return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
