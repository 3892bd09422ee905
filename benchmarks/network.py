"""Network: what the egress datapath, the TLS-intercepting proxy and the router cost, each beside its peer measured
in the same run (docs/design/network.md).

    python benchmarks/network.py [--bytes 1073741824] [--runs 3] [--connects 20] [--tls-runs 50]
                                 [--router-runs 200] [--only nat,connect,tls,router,sandbox]

Runs inside a network namespace of its own (re-executes itself through scripts/isolated.sh) with a fake internet
(keepstate.testing.internet) as the only way out, so nothing it sends leaves the machine. PYTHONPATH defaults to
this checkout, so the server it starts runs this checkout's code.
  * NAT throughput: curl in a sandbox-like slot (runtime.network.create(link_for(slot)): netns, veth) downloading
    --bytes from the fake internet's bulk server through the server's datapath (the egress service's nftables
    slot with a default policy when that exists, else a bare kernel masquerade, as said in the output), beside the
    same download over the same hops without NAT or policy (a namespace on a veth into this one, routed on into
    the fake internet). Goal >= 90 %. One plain veth straight into the fake internet is printed too: the slot's
    path has a second veth only because the fake internet is reached by one, where a real host has its NIC.
    The same download from inside a real gVisor sandbox is printed for information.
  * Connection set-up from a sandbox: connect() to an allowed address beside one its policy denies (`denyOut`).
    Goal: the denied one fails in < 1 s (a reset, not a drop).
  * HTTPS through the TLS-intercepting proxy (a host with a header rule) beside the same request passed through
    (a host without rules), p50 of --tls-runs, new connection each. Goal: interception adds < 2 ms.
  * A port URL through the router (`Host: <port>-<id>.<domain>`) beside the same request straight to the
    sandbox's address, p50 of --router-runs, a new connection each (python's http.server: HTTP/1.0, so the router
    too connects anew each time). Goal: the router adds < 1 ms p50. The same with an HTTP/1.1 server and
    connections kept on both paths is printed too.
A part that cannot run (a feature this checkout lacks) says so and why; the others still run.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
if "PYTHONPATH" not in os.environ:  # this checkout's code, here and in the server it starts
    os.environ["PYTHONPATH"] = str(REPO)
    sys.path.insert(0, str(REPO))
from common import median, row, server  # noqa: E402

MARKER = "KEEPSTATE_BENCH_ISOLATED"
ALLOWED, DENIED = "198.51.100.13", "198.51.100.14"  # other.test, denied.test
INTERCEPTED, PASSED = "a.allowed.test", "b.allowed.test"
DIRECT_NS_IP, DIRECT_PEER_IP = "203.0.113.6", "203.0.113.5"  # the no-NAT peer's own /30 into the fake internet
failures: list[str] = []


def run(*args: str, check: bool = True, stdin: str | None = None) -> str:
    proc = subprocess.run(list(args), input=stdin, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise OSError(f"{' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def part(name: str, fn: Callable[[], None]) -> None:
    """Run one part; a failure is printed (which part, why) and the next part still runs."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        failures.append(f"{name}: {type(e).__name__}: {e}")
        print(f"  {name}: FAILED: {type(e).__name__}: {e}")
        if os.environ.get("KEEPSTATE_BENCH_TRACE"):
            traceback.print_exc()


def goal(text: str, met: bool) -> None:
    print(f"    goal {text}: {'met' if met else 'NOT MET'}")


# -- downloads ------------------------------------------------------------------------------------------------------
def curl_download(netns: str, url: str) -> float:
    """Gbit/s of one curl download of `url` from inside `netns` (the body is thrown away)."""
    out = run("nsenter", f"--net=/run/netns/{netns}", "curl", "-sS", "--max-time", "300", "-o", "/dev/null",
              "-w", "%{size_download} %{time_total}", url)
    size, seconds = out.split()
    return int(size) * 8 / float(seconds) / 1e9


def _client_namespace(tag: str, ns_ip: str, gateway_ip: str) -> tuple[str, str]:
    """A namespace `ks<tag>-<pid>` whose eth0 (ns_ip/30, default route via gateway_ip) is one end of a veth; the
    other end, `ks<tag>1`, is left in this namespace for the caller to place. (namespace, that end's name)."""
    ns = f"ks{tag}-{os.getpid()}"
    run("ip", "netns", "add", ns)
    try:
        run("ip", "link", "add", f"ks{tag}0", "type", "veth", "peer", "name", f"ks{tag}1")
        run("ip", "link", "set", f"ks{tag}0", "netns", ns)
        run("nsenter", f"--net=/run/netns/{ns}", "ip", "-batch", "-",
            stdin=f"link set lo up\nlink set ks{tag}0 name eth0\naddr add {ns_ip}/30 dev eth0\n"
                  f"link set eth0 up\nroute add default via {gateway_ip}\n")
    except BaseException:
        run("ip", "netns", "del", ns, check=False)
        raise
    return ns, f"ks{tag}1"


@contextmanager
def direct_namespace(fi: Any) -> Iterator[str]:
    """A namespace on a veth straight into the fake internet: the same download with no NAT and no filter."""
    ns, end = _client_namespace("bd", DIRECT_NS_IP, DIRECT_PEER_IP)
    try:
        run("ip", "link", "set", end, "netns", fi.netns)
        run(*fi.nsenter("ip", "-batch", "-"), stdin=f"addr add {DIRECT_PEER_IP}/30 dev {end}\nlink set {end} up\n")
        yield ns
    finally:
        run("ip", "netns", "del", ns, check=False)  # the veth pair goes with it


ROUTED_NS_IP, ROUTED_HOST_IP = "203.0.113.10", "203.0.113.9"  # the routed peer's /30, into this namespace
ROUTED_NET = "203.0.113.8/30"


@contextmanager
def routed_namespace(fi: Any) -> Iterator[str]:
    """A namespace on a veth into THIS namespace, which routes it on into the fake internet: the NAT slot's path
    hop for hop (two veths, forwarding here), without NAT and without a slot's policy chains."""
    ns, end = _client_namespace("br", ROUTED_NS_IP, ROUTED_HOST_IP)
    try:
        run("ip", "-batch", "-", stdin=f"addr add {ROUTED_HOST_IP}/30 dev {end}\nlink set {end} up\n")
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
        run(*fi.nsenter("ip", "route", "replace", ROUTED_NET, "via", "203.0.113.1"))
        yield ns
    finally:
        run(*fi.nsenter("ip", "route", "del", ROUTED_NET), check=False)
        run("ip", "netns", "del", ns, check=False)


class EgressSlot:
    """The egress service (keepstate.egress.service) running in a thread's event loop, one slot attached with a
    default policy: the server's real datapath, without a server around it."""

    def __init__(self, home: Path, dns: str) -> None:
        from keepstate.egress import firewall
        from keepstate.egress.policy import parse
        from keepstate.egress.service import Egress, EgressConfig

        if not firewall.available():
            raise RuntimeError("nft is not installed")
        firewall.ensure_base()
        self.egress = Egress(home, EgressConfig(dns_upstreams=(dns,)))
        self.policy = parse({})
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self.egress.start(), self.loop).result(30)

    def attach(self, slot: int) -> None:
        self.egress.attach(slot, "bench", self.policy)

    def close(self, slot: int) -> None:
        try:
            self.egress.detach(slot, "bench")
        finally:
            asyncio.run_coroutine_threadsafe(self.egress.stop(), self.loop).result(30)
            self.loop.call_soon_threadsafe(self.loop.stop)


@contextmanager
def nat_slot(fi: Any, home: Path) -> Iterator[tuple[str, str]]:
    """A sandbox-like slot (netns ksN, veth ksvN) whose traffic goes through this namespace's NAT; (netns, how)."""
    from keepstate.runtime import network

    slot = next(s for s in range(network.MAX_SLOTS - 1, 0, -1) if network.claim_slot(s))
    link = network.link_for(slot)
    egress: EgressSlot | None = None
    masquerade = ["POSTROUTING", "-s", str(network.BASE), "!", "-o", "ksv+", "-j", "MASQUERADE"]
    try:
        network.create(link)
        try:
            egress = EgressSlot(home, fi.state["dns"])
            egress.attach(slot)
            how = "the egress service's nftables slot, default policy"
        except Exception as e:  # noqa: BLE001 - the fallback is said in the output
            if egress is not None:
                egress.close(slot)
                egress = None
            how = f"kernel masquerade only (egress service unavailable: {type(e).__name__}: {e})"
            Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
            run("iptables", "-w", "-t", "nat", "-A", *masquerade)
        yield link.netns, how
    finally:
        if egress is not None:
            egress.close(slot)
        else:
            run("iptables", "-w", "-t", "nat", "-D", *masquerade, check=False)
        network.destroy(link)
        network.release_slot(slot)


def bench_nat(fi: Any, args: argparse.Namespace, home: Path) -> None:
    url = f"http://{fi.state['bulk']['host']}:{fi.state['bulk']['port']}/bytes?n={args.bytes}"
    with direct_namespace(fi) as direct, routed_namespace(fi) as routed, nat_slot(fi, home) as (slot_ns, how):
        print(f"  NAT path: {how}")
        nat, plain, hops = [], [], []
        for _ in range(args.runs):  # alternated, so drift in the machine's load hits all alike
            plain.append(curl_download(direct, url))
            hops.append(curl_download(routed, url))
            nat.append(curl_download(slot_ns, url))
    ours, peer, one = median(nat), median(hops), median(plain)
    print(row(f"download {args.bytes >> 20} MiB, Gbit/s (median of {args.runs})", ours, peer, "Gb",
              "plain veths, routed, no NAT"))
    goal(">= 90 % of the same veths without NAT and policy", ours >= 0.9 * peer)
    print(f"  (one plain veth straight into the fake internet, no forwarding at all: {one:.1f} Gbit/s; the "
          f"sandbox path has a second veth here because the fake internet is one, where a host has its NIC)")


# -- the parts that need a server and sandboxes ----------------------------------------------------------------
def sandbox_python(sbx: Any, code: str, timeout: float = 300) -> Any:
    """Run `code` with the sandbox's python3; its last stdout line, parsed as JSON."""
    sbx.files.write("/tmp/bench.py", code)
    result = sbx.commands.run("python3 /tmp/bench.py", timeout=timeout)
    return json.loads(result.stdout.strip().splitlines()[-1])


CONNECT_CODE = """
import json, socket, time
out = {}
for target in %r:
    times, errors = [], []
    for _ in range(%d):
        t = time.perf_counter()
        try:
            socket.create_connection((target, 80), timeout=10).close()
            errors.append(None)
        except OSError as e:
            errors.append(type(e).__name__)
        times.append((time.perf_counter() - t) * 1000)
    out[target] = {"ms": times, "errors": errors}
print(json.dumps(out))
"""


def bench_connect(sbx: Any, args: argparse.Namespace) -> None:
    out = sandbox_python(sbx, CONNECT_CODE % ([ALLOWED, DENIED], args.connects))
    allowed, denied = out[ALLOWED], out[DENIED]
    if any(allowed["errors"]):
        raise RuntimeError(f"connections to the allowed {ALLOWED} failed: {sorted(set(allowed['errors']) - {None})}"
                           " (no egress datapath in this server?)")
    if None in denied["errors"]:
        raise RuntimeError(f"a connection to the denied {DENIED} succeeded: denyOut not applied")
    print(row(f"connect() refused by denyOut, ms (median of {args.connects})", median(denied["ms"]),
              median(allowed["ms"]), "ms", "allowed (succeeds)"))
    print(f"    denied: {sorted(set(denied['errors']))}, slowest {max(denied['ms']):.1f} ms")
    goal("denied fails < 1 s", max(denied["ms"]) < 1000)


TLS_CODE = """
import json, socket, ssl, time
ctx = ssl.create_default_context()
hosts = %r
addresses = {h: socket.getaddrinfo(h, 443, socket.AF_INET, socket.SOCK_STREAM)[0][4][0] for h in hosts}
out = {h: {"ms": [], "echo": None} for h in hosts}
for i in range(%d + 1):
    for h in hosts:
        t = time.perf_counter()
        with socket.create_connection((addresses[h], 443), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname=h) as s:
                s.sendall(("GET /echo HTTP/1.1\\r\\nHost: %%s\\r\\nConnection: close\\r\\n\\r\\n" %% h).encode())
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
        ms = (time.perf_counter() - t) * 1000
        if i:  # the first round warms up (certificate issue, caches)
            out[h]["ms"].append(ms)
        out[h]["echo"] = json.loads(data.partition(b"\\r\\n\\r\\n")[2])
print(json.dumps(out))
"""


def bench_tls(sbx: Any, args: argparse.Namespace) -> None:
    out = sandbox_python(sbx, TLS_CODE % ([INTERCEPTED, PASSED], args.tls_runs))
    rewritten = out[INTERCEPTED]["echo"]["headers"].get("x-bench")
    untouched = out[PASSED]["echo"]["headers"].get("x-bench")
    if rewritten != "intercepted" or untouched is not None:
        raise RuntimeError(f"the header rule was not applied as set (x-bench {INTERCEPTED}: {rewritten!r}, "
                           f"{PASSED}: {untouched!r}): no intercepting proxy in this server?")
    ours, peer = median(out[INTERCEPTED]["ms"]), median(out[PASSED]["ms"])
    print(row(f"HTTPS GET, intercepted vs passed, ms (p50 of {args.tls_runs})", ours, peer, "ms", "passed through"))
    goal("interception adds < 2 ms", ours - peer < 2)


SERVE_CODE = "cd /tmp && exec python3 -m http.server 8000 --bind 0.0.0.0"
# The same server speaking HTTP/1.1 (keep-alive) on 8001, for the keep-alive figures.
SERVE_11_CODE = "cd /tmp && exec python3 -m http.server 8001 --bind 0.0.0.0 --protocol HTTP/1.1"
ADDRESS_CODE = """
import json, socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect(("203.0.113.50", 9))  # routing only: UDP connect sends nothing
print(json.dumps(s.getsockname()[0]))
"""


def timed_get(host: str, port: int, headers: dict[str, str], conn: http.client.HTTPConnection | None = None) -> float:
    """One GET, on a new connection (closed after) unless given one to keep using. On a kept connection the answer's
    segments are acknowledged at once (TCP_QUICKACK, as the router does on its kept connections into a sandbox):
    else Linux delays the ACK of the server's first send, and python's http.server, which sends headers and body
    apart, has the body held by Nagle until it comes, 40 ms a request."""
    t = time.perf_counter()
    own = conn is None
    if conn is None:
        conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", "/", headers=headers)
        if not own and conn.sock is not None:
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        resp = conn.getresponse()
        resp.read()
        if resp.status != 200:
            raise RuntimeError(f"GET http://{host}:{port}/ {headers}: {resp.status}")
    finally:
        if own:
            conn.close()
    return (time.perf_counter() - t) * 1000


def wait_serving(host: str, port: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            timed_get(host, port, {})
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def bench_router(sbx: Any, srv: Any, args: argparse.Namespace) -> None:
    address = sandbox_python(sbx, ADDRESS_CODE)
    sbx.commands.run(SERVE_CODE, background=True)
    sbx.commands.run(SERVE_11_CODE, background=True)
    wait_serving(address, 8000)
    wait_serving(address, 8001)
    host = sbx.get_host(8000)  # <port>-<id>.<domain>; the domain names the router's port when it has its own
    router_port = int(host.rsplit(":", 1)[1]) if ":" in host else int(srv.url.rsplit(":", 1)[1])
    routed, direct = [], []
    for _ in range(args.router_runs):  # a new connection each, to the router and to the sandbox alike
        routed.append(timed_get("127.0.0.1", router_port, {"Host": host}))
        direct.append(timed_get(address, 8000, {}))
    ours, peer = median(routed), median(direct)
    print(row(f"port URL GET, router vs direct, ms (p50 of {args.router_runs})", ours, peer, "ms",
              f"direct to {address}"))
    goal(f"the router adds < 1 ms p50 (it adds {ours - peer:.2f} ms)", ours - peer < 1)
    # Information: an HTTP/1.1 server and clients that keep their connections (the router keeps its own into the
    # sandbox), as a browser or an SDK would use a port URL.
    host11 = sbx.get_host(8001)
    to_router = http.client.HTTPConnection("127.0.0.1", router_port, timeout=10)
    to_sandbox = http.client.HTTPConnection(address, 8001, timeout=10)
    routed, direct = [], []
    try:
        for _ in range(args.router_runs):
            routed.append(timed_get("127.0.0.1", router_port, {"Host": host11}, to_router))
            direct.append(timed_get(address, 8001, {}, to_sandbox))
    finally:
        to_router.close()
        to_sandbox.close()
    print(row("  the same, keep-alive both ways (information)", median(routed), median(direct), "ms",
              f"direct to {address}"))


def bench_sandbox_download(sbx: Any, fi: Any, args: argparse.Namespace) -> None:
    url = f"http://{fi.state['bulk']['host']}:{fi.state['bulk']['port']}/bytes?n={args.bytes}"
    speeds = []
    for _ in range(args.runs):
        out = sbx.commands.run(f"curl -sS --max-time 300 -o /dev/null -w '%{{size_download}} %{{time_total}}' "
                               f"'{url}'", timeout=330).stdout.split()
        speeds.append(int(out[0]) * 8 / float(out[1]) / 1e9)
    print(f"  download {args.bytes >> 20} MiB from inside a gVisor sandbox: {median(speeds):.2f} Gbit/s "
          f"(median of {args.runs}; information)")


def serve_flags(fi: Any) -> tuple[str, ...]:
    """Point the server at the fake internet, with the flags this `keepstate serve` has."""
    from common import KEEPSTATE

    text = run(str(KEEPSTATE), "serve", "--help")
    flags: list[str] = []
    if "--dns-upstream" in text:
        flags += ["--dns-upstream", fi.state["dns"]]
    if "--egress-ca-bundle" in text:
        flags += ["--egress-ca-bundle", fi.ca_file]
    if not flags:
        print("  (this keepstate serve has neither --dns-upstream nor --egress-ca-bundle: no egress yet)")
    return tuple(flags)


def with_server(fi: Any, args: argparse.Namespace, only: set[str]) -> None:
    with server(pool=1, extra=serve_flags(fi)) as srv:
        srv.sdk_env()
        from e2b import Sandbox

        made: list[Any] = []
        try:
            def sandbox(network: dict[str, Any]) -> Any:
                sbx = Sandbox.create(timeout=900, network=network)  # type: ignore[arg-type]
                made.append(sbx)
                return sbx

            plain: Any = None

            def plain_sandbox() -> Any:
                nonlocal plain
                if plain is None:
                    plain = sandbox({"deny_out": [DENIED]})
                return plain

            if "sandbox" in only:
                part("download from a gVisor sandbox", lambda: bench_sandbox_download(plain_sandbox(), fi, args))
            if "connect" in only:
                part("connection set-up", lambda: bench_connect(plain_sandbox(), args))
            if "router" in only:
                part("router", lambda: bench_router(plain_sandbox(), srv, args))
            if "tls" in only:
                rules = {INTERCEPTED: [{"transform": {"headers": {"X-Bench": "intercepted"}}}]}
                part("TLS interception", lambda: bench_tls(sandbox({"rules": rules}), args))
        finally:
            for sbx in made:
                try:
                    sbx.kill()
                except Exception:  # noqa: BLE001 - the server's --reap-on-exit takes what is left
                    pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, default=1 << 30)
    parser.add_argument("--runs", type=int, default=3, help="downloads of --bytes per path")
    parser.add_argument("--connects", type=int, default=20)
    parser.add_argument("--tls-runs", type=int, default=50)
    parser.add_argument("--router-runs", type=int, default=200)
    parser.add_argument("--only", default="nat,sandbox,connect,tls,router")
    args = parser.parse_args()
    if not os.environ.get(MARKER):
        os.environ[MARKER] = "1"
        os.execvp("bash", ["bash", str(REPO / "scripts" / "isolated.sh"), sys.executable, __file__, *sys.argv[1:]])
    from keepstate.testing.internet import FakeInternet, in_root_netns

    if in_root_netns():
        raise SystemExit("not isolated: run through scripts/isolated.sh")
    only = set(args.only.split(","))
    fi = FakeInternet(f"bench{os.getpid()}")
    fi.up()
    home = Path(fi.state["dir"]) / "egress-home"
    print(f"network benchmark (isolated netns {os.environ.get('KEEPSTATE_ISOLATED_NETNS')}, fake internet "
          f"{fi.netns}); ours beside the peer:")
    try:
        if "nat" in only:
            part("NAT throughput", lambda: bench_nat(fi, args, home))
        if only & {"sandbox", "connect", "tls", "router"}:
            part("server", lambda: with_server(fi, args, only))
    finally:
        fi.down()
    if failures:
        print("parts that failed:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
