"""The nftables datapath with real packets, no gVisor: three namespaces of the test's own, a "server" one holding the
table and a slot's veth (ksvN, as runtime/network.py makes it), a "sandbox" one behind it, and an "internet" one
(198.51.100.10 and .13 listening) as the server namespace's only route. Nothing here touches the host's namespace.

Checks what the kernel does with each policy: an unattached slot sends nothing; the default reaches the internet
(masqueraded) but never the always-denied ranges; deny and allow entries; a live update cuts what it denies; bytes
are counted; a refused connection is refused at once (reset or ICMP), never left to time out."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from keepstate.egress import firewall as fw
from keepstate.egress import policy
from keepstate.netaddr import GATEWAY_IP, link_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nft") or not shutil.which("conntrack"),
                                reason="needs root, nft and conntrack")

SLOT = 9
LINK = link_for(SLOT)
SITES = ("198.51.100.10", "198.51.100.13")
PORT = 8080

HOLD = 8081  # answers and keeps the connection open
SERVE = """
import socket, threading
held = []
def serve(addr, port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((addr, port)); s.listen(64)
    while True:
        c, peer = s.accept(); c.sendall(("hello from %%s to %%s\\n" %% (addr, peer[0])).encode())
        if port == %d: held.append(c)
        else: c.close()
for a in %r:
    for p in (%d, %d):
        threading.Thread(target=serve, args=(a, p), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
""" % (HOLD, SITES, PORT, HOLD)

CONNECT = """
import socket, sys
s = socket.socket(); s.settimeout(10)
try:
    s.connect((sys.argv[1], int(sys.argv[2]))); print(s.recv(100).decode().strip() or "empty")
except socket.timeout: print("timeout")
except ConnectionRefusedError: print("refused")
except OSError as e: print("error", e.errno)
"""


@dataclass
class Net:
    server: str
    sandbox: str
    internet: str

    def run(self, ns: str, *args: str) -> str:
        return subprocess.run(["nsenter", f"--net=/run/netns/{ns}", *args], check=True, capture_output=True,
                              text=True).stdout

    def connect(self, address: str, port: int = PORT) -> str:
        return self.run(self.sandbox, sys.executable, "-c", CONNECT, address, str(port)).strip()


@pytest.fixture
def net(monkeypatch: pytest.MonkeyPatch) -> Iterator[Net]:
    tag = uuid.uuid4().hex[:6]
    n = Net(f"kse-s{tag}", f"kse-b{tag}", f"kse-i{tag}")
    made: list[str] = []
    server_proc = None
    try:
        for ns in (n.server, n.sandbox, n.internet):
            subprocess.run(["ip", "netns", "add", ns], check=True)
            made.append(ns)
            n.run(ns, "ip", "link", "set", "lo", "up")
        sh = f"nsenter --net=/run/netns/{n.server} "
        for cmd in (
            f"ip link add {LINK.host_if} type veth peer name eth0 netns {n.sandbox}",
            f"ip addr add {LINK.host_ip}/30 dev {LINK.host_if}", f"ip link set {LINK.host_if} up",
            f"ip link add up0 type veth peer name eth0 netns {n.internet}",
            "ip addr add 203.0.113.5/30 dev up0", "ip link set up0 up",
            "ip route add default via 203.0.113.6", f"ip addr add {GATEWAY_IP}/32 dev lo",
            "sysctl -qw net.ipv4.ip_forward=1",
        ):
            subprocess.run(sh + cmd, shell=True, check=True)
        for cmd in (f"ip addr add {LINK.sandbox_ip}/30 dev eth0", "ip link set eth0 up",
                    f"ip route add default via {LINK.host_ip}"):
            n.run(n.sandbox, *cmd.split())
        for cmd in ["ip addr add 203.0.113.6/30 dev eth0", "ip link set eth0 up",
                    *(f"ip addr add {a}/32 dev lo" for a in SITES)]:
            n.run(n.internet, *cmd.split())  # no route back to 10.88/16: only masqueraded traffic is answered
        server_proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{n.internet}", sys.executable, "-c", SERVE],
                                       stdout=subprocess.PIPE, text=True)
        assert server_proc.stdout is not None and server_proc.stdout.readline().strip() == "ready"
        monkeypatch.setattr(fw, "NFT", ["nsenter", f"--net=/run/netns/{n.server}", "nft"])
        monkeypatch.setattr(fw, "CONNTRACK", ["nsenter", f"--net=/run/netns/{n.server}", "conntrack"])
        fw.ensure_base(())
        yield n
    finally:
        if server_proc is not None:
            server_proc.kill()
            server_proc.wait()
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], check=False)


def attach(body: dict | None = None, aia: bool = True, limits: fw.Limits | None = None) -> None:
    fw.apply(SLOT, LINK, policy.parse(body, allow_internet_access=aia), fw.Ports(dns=5353), limits or fw.Limits())


def test_an_unattached_slot_sends_nothing(net: Net) -> None:
    assert net.connect(SITES[0]) == "refused"


def test_default_policy_reaches_the_internet_masqueraded_and_is_counted(net: Net) -> None:
    attach()
    assert net.connect(SITES[0]) == f"hello from {SITES[0]} to 203.0.113.5"  # masqueraded
    tx, rx = fw.counters()[SLOT]
    assert tx > 0 and rx > 0
    fw.detach(SLOT, LINK)
    assert net.connect(SITES[0]) == "refused" and SLOT not in fw.counters()


def test_always_denied_ranges_stay_refused(net: Net) -> None:
    attach({"allowOut": ["0.0.0.0/0"]})
    for address in ("169.254.169.254", "10.88.0.2", "127.0.0.1", "192.168.1.1"):
        assert net.connect(address, 80) in ("refused", "error 113"), address  # 113: EHOSTUNREACH (ICMP)
    # the host's own addresses: only GATEWAY_IP, and there only what listens (nothing here: a reset)
    assert net.connect(LINK.host_ip, 22) == "refused"
    assert net.connect(GATEWAY_IP, 22) == "refused"


def test_deny_and_allow_entries(net: Net) -> None:
    attach({"denyOut": [SITES[1]]})
    assert net.connect(SITES[1]) == "refused" and net.connect(SITES[0]).startswith("hello")
    attach({"allowOut": [SITES[1]], "denyOut": ["0.0.0.0/0"]})
    assert net.connect(SITES[0]) == "refused" and net.connect(SITES[1]).startswith("hello")
    attach({}, aia=False)
    assert net.connect(SITES[0]) == "refused" and net.connect(SITES[1]) == "refused"


def test_a_connection_limit_refuses_the_one_too_many(net: Net) -> None:
    attach(limits=fw.Limits(max_connections=2))
    hold = subprocess.Popen(["nsenter", f"--net=/run/netns/{net.sandbox}", sys.executable, "-c",
                             "import socket, sys\n"
                             f"a = [socket.create_connection(('{SITES[0]}', {HOLD})) for _ in range(2)]\n"
                             "[c.recv(100) for c in a]; print('held', flush=True); sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert hold.stdout is not None and hold.stdout.readline().strip() == "held"
        assert net.connect(SITES[1], HOLD) == "refused"  # the third, while two are open
    finally:
        assert hold.stdin is not None
        hold.stdin.close()
        hold.wait()
    attach(limits=fw.Limits(max_connections=0))
    assert net.connect(SITES[1], HOLD).startswith("hello")


def test_an_update_cuts_what_it_denies(net: Net) -> None:
    attach()
    assert net.connect(SITES[0]).startswith("hello")
    entries = net.run(net.server, "conntrack", "-L", "--orig-src", LINK.sandbox_ip)
    assert SITES[0] in entries
    attach({"denyOut": ["0.0.0.0/0"]})
    fw.cut_connections(LINK)
    assert SITES[0] not in net.run(net.server, "conntrack", "-L", "--orig-src", LINK.sandbox_ip)
    assert net.connect(SITES[0]) == "refused"


def test_an_established_connection_a_new_policy_denies_is_reset(net: Net) -> None:
    attach()
    script = ("import socket, sys\n"
              f"c = socket.create_connection(('{SITES[0]}', {HOLD})); c.settimeout(10); c.recv(100)\n"
              "print('open', flush=True); sys.stdin.readline()\n"
              "try:\n"
              "    c.sendall(b'x' * 1000); c.recv(100); print('still open')\n"
              "except (ConnectionResetError, BrokenPipeError): print('reset')\n"
              "except socket.timeout: print('timeout')\n")
    proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{net.sandbox}", sys.executable, "-c", script],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    assert proc.stdout.readline().strip() == "open"
    attach({"denyOut": [SITES[0]]})
    fw.cut_connections(LINK)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "reset"
    proc.wait()
