"""The egress datapath in nftables: table `inet keepstate`, shared by every server on the host (docs/design/network.md).

Base chains (made idempotently by `ensure_base`; a server never touches another server's slots):
    prerouting  (nat)     iifname vmap @slot_pre -> pre_N: DNS for GATEWAY_IP to the resolver, TCP to the egress proxy
    forward     (filter)  iifname/oifname vmap @slot_fwd -> fwd_N: counters, limits, the policy; then reject
    postrouting (nat)     10.88.0.0/16 leaving by a non-sandbox interface is masqueraded
    input       (filter)  from ksv*: replies, GATEWAY_IP, the open ports; everything else rejected

A slot's chains are rendered by the pure `render_slot` and applied in one `nft -f -` transaction, so a policy change
is applied at once and never half. Everything a sandbox may not send is rejected (TCP reset, ICMP otherwise), never
dropped: a connection left half-open blocks its checkpoints (see install_base).
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

from keepstate.netaddr import BASE, GATEWAY_IP, Link

from .policy import Net, Policy

TABLE = "inet keepstate"
CHAIN = "KEEPSTATE-IN"  # iptables chains of releases before nftables, removed at start
FWD_CHAIN = "KEEPSTATE-FWD"
# What no policy opens (design: "Always denied"); GATEWAY_IP is in 10.88.0.0/16 but is reached by `input`.
ALWAYS_DENIED = tuple(ipaddress.IPv4Network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4"))
NFT = ["nft"]  # tests prefix these with nsenter to work in a namespace of their own
CONNTRACK = ["conntrack"]


@dataclass(frozen=True)
class Ports:
    """Where this server's resolver and egress proxy listen on GATEWAY_IP (proxy None: no proxy)."""

    dns: int
    proxy: int | None = None


@dataclass(frozen=True)
class Limits:
    max_connections: int = 1024  # concurrent, per sandbox; 0: no limit
    rate_mbit: float = 0.0  # per direction; 0: unlimited


def denied_nets(allowed_private: Iterable[Net] = ()) -> list[ipaddress.IPv4Network]:
    """The always-denied ranges minus the operator's `--egress-allow-private` exemptions (sandboxes never)."""
    nets = list(ALWAYS_DENIED)
    for exempt in allowed_private:
        if not isinstance(exempt, ipaddress.IPv4Network) or exempt.overlaps(BASE):
            continue  # the sandboxes' own range stays denied whatever the operator says
        out: list[ipaddress.IPv4Network] = []
        for n in nets:
            if exempt.supernet_of(n):
                continue
            if n.supernet_of(exempt):
                out.extend(n.address_exclude(exempt))
            else:
                out.append(n)
        nets = out
    return sorted(ipaddress.collapse_addresses(nets))


def _set(nets: Iterable[Net]) -> str:
    return "{ " + ", ".join(str(n) for n in nets) + " }"


def _reject(match: str) -> list[str]:
    """A reject that fails fast: a reset for TCP, ICMP administratively-prohibited for the rest."""
    m = f"{match} " if match else ""
    return [f"{m}meta l4proto tcp reject with tcp reset", f"{m}reject with icmpx admin-prohibited"]


def render_slot(slot: int, link: Link, policy: Policy, ports: Ports, limits: Limits,
                allowed_private: Iterable[Net] = ()) -> str:
    """The nft script that (re)writes slot N's chains and map entries for `policy`: pure, for tests and for
    `apply`. Idempotent: it creates what is missing and replaces the chains' rules whole."""
    t, n, ifname = TABLE, slot, link.host_if
    denied = denied_nets(allowed_private)
    v4_allow = [a for a in policy.open_nets if a.version == 4]
    v4_deny = [d for d in policy.deny_nets if d.version == 4]
    lines = [f"add chain {t} pre_{n}", f"flush chain {t} pre_{n}",
             f"add chain {t} fwd_{n}", f"flush chain {t} fwd_{n}",
             f"add counter {t} tx_{n}", f"add counter {t} rx_{n}"]
    pre = [f"ip daddr {GATEWAY_IP} meta l4proto {{ tcp, udp }} th dport 53 dnat ip to {GATEWAY_IP}:{ports.dns}"]
    if policy.needs_proxy and ports.proxy is not None:
        # The proxy decides by name and dials the original destination (SO_ORIGINAL_DST); what is always denied
        # is left to `forward`, which rejects it, so the proxy never even sees it.
        # The host's own addresses are not for the proxy to dial either: left to `input`, which refuses them.
        pre += [f"ip daddr {_set(denied)} return", "fib daddr type local return",
                f"meta l4proto tcp dnat ip to {GATEWAY_IP}:{ports.proxy}"]
    fwd: list[str] = []
    rate = f"limit rate over {int(limits.rate_mbit * 125_000)} bytes/second burst " \
           f"{max(int(limits.rate_mbit * 125_000), 65536)} bytes" if limits.rate_mbit > 0 else ""
    # Into the sandbox: replies only (inbound traffic comes from the host over the link, not through forward).
    if rate:
        fwd.append(f'oifname "{ifname}" ct state established {rate} drop')
    fwd.append(f'oifname "{ifname}" ct state established,related counter name "rx_{n}" accept')
    fwd += _reject(f'oifname "{ifname}"')
    # Out of it.
    fwd.append(f'counter name "tx_{n}"')
    if rate:  # established packets only: a handshake is never dropped
        fwd.append(f"ct state established {rate} drop")
    fwd.append("ct state established,related accept")
    fwd.append("meta nfproto ipv6 reject with icmpx admin-prohibited")  # IPv6 is not routed
    fwd += _reject(f"ip daddr {_set(denied)}")
    if limits.max_connections > 0:
        fwd += _reject(f"ct state new ct count over {limits.max_connections}")
    if v4_allow:
        fwd.append(f"ip daddr {_set(v4_allow)} accept")
    if policy.denies_all:
        fwd += _reject("")
    else:
        if v4_deny:
            fwd += _reject(f"ip daddr {_set(v4_deny)}")
        fwd.append("accept")
    lines += [f"add rule {t} pre_{n} {r}" for r in pre]
    lines += [f"add rule {t} fwd_{n} {r}" for r in fwd]
    lines += [f'add element {t} slot_pre {{ "{ifname}" : jump pre_{n} }}',
              f'add element {t} slot_fwd {{ "{ifname}" : jump fwd_{n} }}']
    return "\n".join(lines) + "\n"


def render_detach(slot: int, link: Link) -> str:
    """Remove slot N's chains, counters and map entries; idempotent (each is made first, then deleted, in one
    transaction, so a missing one is no error)."""
    t, n, ifname = TABLE, slot, link.host_if
    return "\n".join([
        f"add chain {t} pre_{n}", f"add chain {t} fwd_{n}", f"add counter {t} tx_{n}", f"add counter {t} rx_{n}",
        f'add element {t} slot_pre {{ "{ifname}" : jump pre_{n} }}',
        f'add element {t} slot_fwd {{ "{ifname}" : jump fwd_{n} }}',
        f'delete element {t} slot_pre {{ "{ifname}" }}', f'delete element {t} slot_fwd {{ "{ifname}" }}',
        f"delete chain {t} pre_{n}", f"delete chain {t} fwd_{n}",
        f"delete counter {t} tx_{n}", f"delete counter {t} rx_{n}",
    ]) + "\n"


def render_base(open_ports: tuple[int, ...] = ()) -> str:
    """The shared base chains, rewritten whole (the maps, holding every server's slots, are only created).

    A slot no server attached (a pooled sandbox, a server run with `--egress off`) has no map entry, so the reject
    rules after the maps refuse everything it sends: nothing leaves."""
    t = TABLE
    lines = [
        f"add table {t}",
        f"add map {t} slot_pre {{ type ifname : verdict; }}",
        f"add map {t} slot_fwd {{ type ifname : verdict; }}",
        f"add chain {t} prerouting {{ type nat hook prerouting priority dstnat; policy accept; }}",
        f"add chain {t} postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}",
        f"add chain {t} forward {{ type filter hook forward priority filter; policy accept; }}",
        f"add chain {t} input {{ type filter hook input priority filter; policy accept; }}",
        f"add chain {t} sandbox_in",
        # The ports of GATEWAY_IP that are ours (gateways, resolvers, proxies of every server on the host): only
        # created here, each server adds and removes its own (open_service), like the maps' slots.
        f"add set {t} services_tcp {{ type inet_service; }}",
        f"add set {t} services_udp {{ type inet_service; }}",
    ]
    for chain in ("prerouting", "postrouting", "forward", "input", "sandbox_in"):
        lines.append(f"flush chain {t} {chain}")
    rules = [("prerouting", "iifname vmap @slot_pre"),
             ("postrouting", f'ip saddr {BASE} oifname != "ksv*" masquerade'),
             ("forward", "iifname vmap @slot_fwd"),
             ("forward", "oifname vmap @slot_fwd")]
    rules += [("forward", r) for r in _reject('iifname "ksv*"')]
    rules += [("forward", r) for r in _reject('oifname "ksv*"')]
    rules.append(("input", 'iifname "ksv*" jump sandbox_in'))
    rules.append(("sandbox_in", "ct state established,related accept"))
    # GATEWAY_IP is on the host's loopback, so whatever listens on every address of the host listens there too:
    # only the ports a server put in the sets are open (the sets serve every server sharing the host).
    rules.append(("sandbox_in", f"ip daddr {GATEWAY_IP} tcp dport @services_tcp accept"))
    rules.append(("sandbox_in", f"ip daddr {GATEWAY_IP} udp dport @services_udp accept"))
    if open_ports:
        rules.append(("sandbox_in", f"tcp dport {{ {', '.join(str(p) for p in open_ports)} }} accept"))
    # Refused at once (a reset), never dropped: see install_base.
    rules += [("sandbox_in", r) for r in _reject("")]
    lines += [f"add rule {t} {chain} {rule}" for chain, rule in rules]
    return "\n".join(lines) + "\n"


def nft(script: str) -> None:
    """Apply a script as one transaction: all of it or none."""
    proc = subprocess.run([*NFT, "-f", "-"], input=script, capture_output=True, text=True)
    if proc.returncode != 0:
        raise OSError(f"nft -f failed: {proc.stderr.strip()}\n--- script ---\n{script}")


def available() -> bool:
    return shutil.which(NFT[-1]) is not None


def _services(verb: str, proto: str, port: int) -> str:
    t = TABLE
    return "\n".join([f"add table {t}", f"add set {t} services_{proto} {{ type inet_service; }}",
                      f"add element {t} services_{proto} {{ {port} }}",
                      *([f"delete element {t} services_{proto} {{ {port} }}"] if verb == "close" else [])]) + "\n"


def open_service(proto: str, port: int) -> None:
    """Let sandboxes reach GATEWAY_IP:`port` (`proto` "tcp" or "udp"): one of this server's services listens there.
    A server killed without its stop leaves the port open until a server opens and closes it again."""
    nft(_services("open", proto, port))


def close_service(proto: str, port: int) -> None:
    nft(_services("close", proto, port))


def ensure_base(open_ports: tuple[int, ...] = ()) -> None:
    nft(render_base(open_ports))


def apply(slot: int, link: Link, policy: Policy, ports: Ports, limits: Limits,
          allowed_private: Iterable[Net] = ()) -> None:
    nft(render_slot(slot, link, policy, ports, limits, allowed_private))


def detach(slot: int, link: Link) -> None:
    nft(render_detach(slot, link))


def counters() -> dict[int, tuple[int, int]]:
    """slot -> (bytes out, bytes in) of every attached slot on the host, in one `nft -j` call."""
    proc = subprocess.run([*NFT, "-j", "list", "counters", "table", *TABLE.split()], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        return {}
    out: dict[int, list[int]] = {}
    for item in json.loads(proc.stdout).get("nftables", []):
        c = item.get("counter")
        if not c or "_" not in c.get("name", ""):
            continue
        kind, _, num = c["name"].partition("_")
        if kind in ("tx", "rx") and num.isdigit():
            out.setdefault(int(num), [0, 0])[0 if kind == "tx" else 1] = int(c.get("bytes", 0))
    return {k: (v[0], v[1]) for k, v in out.items()}


def cut_connections(link: Link) -> None:
    """End the sandbox's own connections (`conntrack -D`): their next packet is judged anew by the new policy,
    and one it denies is answered with a reset. Connections the host opened into the sandbox are left alone."""
    if shutil.which(CONNTRACK[-1]) is None:
        return
    subprocess.run([*CONNTRACK, "-D", "--orig-src", link.sandbox_ip], capture_output=True)


def set_ip_forward() -> None:
    with open("/proc/sys/net/ipv4/ip_forward", "w") as f:
        f.write("1\n")


def install_base(open_ports: tuple[int, ...] = ()) -> None:
    """Filter what sandboxes may send to the host, and forbid forwarding between them (the
    nftables table `inet keepstate`, whose `input` chain admits only replies, GATEWAY_IP and `open_ports`).

    Rebuilt on every server start so a changed port list takes effect; a slot's egress is opened only when the
    server attaches it. A TCP connection a sandbox may not make is refused at once (a reset), not dropped: dropped,
    it would sit half-open in the sandbox (SYN-SENT, retried for about two minutes), and gVisor 20240729 cannot
    checkpoint a TCP endpoint in the middle of a handshake (it panics in resetConnectionLocked), so every pause,
    snapshot and fork of that sandbox would fail meanwhile. Refused, the attempt ends within a round trip.
    """
    if not available():
        raise OSError("nft not found: install nftables (scripts/setup-host.sh does)")
    remove_iptables_chains()
    ensure_base(open_ports)


def remove_iptables_chains() -> None:
    """The iptables chains of releases before nftables: their FORWARD rule would reject every sandbox's egress."""
    if shutil.which("iptables") is None:
        return
    for parent, chain, flag in (("INPUT", CHAIN, "-i"), ("FORWARD", FWD_CHAIN, "-i"), ("FORWARD", FWD_CHAIN, "-o")):
        while _ipt("iptables", "-w", "-D", parent, flag, "ksv+", "-j", chain, check=False).returncode == 0:
            pass
    for chain in (CHAIN, FWD_CHAIN):
        if _ipt("iptables", "-w", "-F", chain, check=False).returncode == 0:
            _ipt("iptables", "-w", "-X", chain, check=False)


def _ipt(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check)
