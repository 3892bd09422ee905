"""`Egress`: a server's way out for its sandboxes, owning the firewall's slots, the resolver and the egress proxy.

The manager attaches a sandbox's slot (with its policy) before its instance runs or restores, updates it on
`PUT /sandboxes/{id}/network`, and detaches it when the instance stops; a slot nobody attached sends nothing
(firewall.render_base). With `serve --egress off` nothing is attached, and nothing leaves, as before egress existed.
Without a datapath (the fake runtime) policies are only remembered, so the API behaves the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import shutil
import socket
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keepstate import netaddr
from keepstate.netaddr import GATEWAY_IP, Link, link_for

from . import firewall
from .ca import CA
from .policy import Net, Policy
from .proxy import Proxy
from .resolver import Resolver, parse_upstream, system_upstreams

log = logging.getLogger("keepstate.egress")
HOSTS_EVERY = 2.0  # seconds between looks at the connection table for hosts not seen before
CA_DIR = "/etc/keepstate"


@dataclass(frozen=True)

class EgressConfig:
    enabled: bool = True
    dns_upstreams: tuple[str, ...] = ()  # IP[:PORT]; none: the host's /etc/resolv.conf
    ca_bundle: Path | None = None  # more CAs sandboxes and the proxy trust (a test CA, a corporate one)
    allow_private: tuple[str, ...] = ()  # CIDRs exempted from the always-denied ranges
    max_connections: int = 1024
    rate_mbit: float = 0.0

    def private_nets(self) -> list[Net]:
        return [ipaddress.ip_network(c, strict=False) for c in self.allow_private]


@dataclass
class Attached:
    sandbox_id: str
    link: Link
    policy: Policy


def is_local(ip: str) -> bool:
    """Whether `ip` is one of this namespace's own addresses (the host's services listen there), asked of the
    kernel's routing without sending anything: a UDP socket connected to a local address gets it as its source."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return bool(s.getsockname()[0] == ip)
    except OSError:
        return False  # unroutable: nothing of ours is there (the dial will fail on its own)


class Egress:
    def __init__(self, home: Path, config: EgressConfig | None = None, datapath: bool = True,
                 secret_value: Callable[[str], Awaitable[str | None]] | None = None,
                 on_host: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.home = home
        self.config = config or EgressConfig()
        self.kernel = datapath  # a real runtime: slots have chains in the kernel to open or close
        self.datapath = datapath and self.config.enabled  # and this server opens them
        self.secret_value = secret_value or _no_secret
        self.on_host = on_host or (lambda sandbox_id, data: None)  # (sandbox ID, {"host", "address", "port"})
        self.ca = CA.load_or_create(home / "tls", "egress")
        self.resolver = Resolver(self.policy_for, self._upstreams())
        self.proxy: Any = None
        self.proxy_port: int | None = None
        self._slots: dict[int, Attached] = {}
        # Slots this server closed and has not opened since: closing one again changes nothing, and each close is an
        # `nft` process (~20 ms, ~60 under load) on every start's path. Empty at start: a slot another server left
        # is closed anew.
        self._closed: set[int] = set()
        self._by_ip: dict[str, int] = {}
        self._policies: dict[str, Policy] = {}  # by sandbox: remembered when there is no datapath too
        self._totals: dict[str, list[int]] = {}  # sandbox -> [out, in] of slots it left, and of the proxy
        self._hosts: dict[str, set[str]] = {}  # sandbox -> hosts (names, else addresses) it has connected to
        self._task: asyncio.Task[None] | None = None
        self._nets = self.config.private_nets()

    def _upstreams(self) -> list[tuple[str, int]]:
        if self.config.dns_upstreams:
            return [parse_upstream(u) for u in self.config.dns_upstreams]
        return system_upstreams()

    # -- start and stop -------------------------------------------------------------------------------------------
    def prepare_host(self, open_ports: tuple[int, ...] = ()) -> None:
        """The host's base table (firewall.install_base: what sandboxes may send to the host, no forwarding between
        them), on a real runtime whether or not this server opens egress; blocking. Before the runtime's prepare."""
        if self.kernel:
            firewall.install_base(open_ports)

    async def start(self) -> None:
        """After prepare_host (the base chains exist) and before adoption (which re-attaches live sandboxes)."""
        if not self.datapath:
            return
        await asyncio.to_thread(netaddr.ensure_gateway_address)
        await asyncio.to_thread(firewall.set_ip_forward)
        await self.resolver.start(GATEWAY_IP)
        await self._start_proxy()
        await asyncio.to_thread(self._services, firewall.open_service)
        self._task = asyncio.get_running_loop().create_task(self._watch_hosts(), name="egress-hosts")
        log.info("egress: resolver on %s:%d (upstreams %s), proxy %s", GATEWAY_IP, self.resolver.port,
                 ", ".join(f"{h}:{p}" for h, p in self.resolver.upstreams) or "none",
                 f"on {GATEWAY_IP}:{self.proxy_port}" if self.proxy_port else "absent")

    async def _start_proxy(self) -> None:
        trust = ssl.create_default_context()
        if self.config.ca_bundle is not None:
            trust.load_verify_locations(cafile=str(self.config.ca_bundle))
        self.proxy = Proxy(
            lookup=self.policy_for, secret_value=self.secret_value, ca=self.ca, upstream_trust=trust,
            guard=self.always_denied, on_bytes=self._proxy_bytes, on_host=self._proxy_host,
            # what the forward chain's `ct count` never sees (proxied connections end at the host)
            max_connections=self.config.max_connections,
            # a secret goes in plain HTTP only to an address the sandbox's resolver gave for that name
            resolved=lambda source, name, ip: ip in self.resolver.memory.addresses(source, name))
        for _ in range(20):  # the proxy takes a port, not 0: a free one, asked for just before
            with socket.socket() as probe:
                probe.bind((GATEWAY_IP, 0))
                chosen = probe.getsockname()[1]
            try:
                await self.proxy.start(GATEWAY_IP, chosen)
            except OSError:
                continue
            self.proxy_port = chosen
            return
        raise OSError(f"no free port on {GATEWAY_IP} for the egress proxy")

    def _services(self, verb: Callable[[str, int], None]) -> None:
        """Open (or close) GATEWAY_IP's ports of the resolver and the proxy to sandboxes (firewall.open_service)."""
        ports = [("udp", self.resolver.port), ("tcp", self.resolver.port)]
        if self.proxy_port is not None:
            ports.append(("tcp", self.proxy_port))
        for proto, port in ports:
            verb(proto, port)

    async def stop(self) -> None:
        """Stop the resolver and the proxy; the slots stay attached for the next server to re-attach."""
        if self.datapath and self.resolver.port:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self._services, firewall.close_service)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.proxy is not None:
            with contextlib.suppress(Exception):
                await self.proxy.stop()
        await self.resolver.stop()

    # -- slots ----------------------------------------------------------------------------------------------------
    def ports(self) -> firewall.Ports:
        return firewall.Ports(dns=self.resolver.port, proxy=self.proxy_port)

    def limits(self) -> firewall.Limits:
        return firewall.Limits(self.config.max_connections, self.config.rate_mbit)

    def attach(self, slot: int, sandbox_id: str, policy: Policy) -> None:
        """Open the slot's egress for a sandbox (blocking: call it in a thread)."""
        self._policies[sandbox_id] = policy
        if slot < 0:
            return
        if not self.datapath:  # `--egress off`: whatever an earlier server opened on the slot is closed
            if self.kernel and slot not in self._closed:
                firewall.detach(slot, link_for(slot))
                self._closed.add(slot)
            return
        self._closed.discard(slot)
        old = self._slots.get(slot)
        if old is not None and old.sandbox_id != sandbox_id:
            self._leave(slot)
        link = link_for(slot)
        firewall.apply(slot, link, policy, self.ports(), self.limits(), self._nets)
        self._slots[slot] = Attached(sandbox_id, link, policy)
        self._by_ip[link.sandbox_ip] = slot
        self._forget_upstreams(link.sandbox_ip)  # none should be left from the slot's last sandbox: make sure

    def update(self, slot: int, sandbox_id: str, policy: Policy) -> None:
        """Replace a running sandbox's policy at once; connections the new one may deny are cut."""
        old = self._policies.get(sandbox_id)
        self._policies[sandbox_id] = policy
        if not self.datapath or slot < 0:
            return
        link = link_for(slot)
        self._closed.discard(slot)
        firewall.apply(slot, link, policy, self.ports(), self.limits(), self._nets)
        attached = self._slots.get(slot)
        if attached is not None and attached.sandbox_id == sandbox_id:
            attached.policy = policy
        else:
            self._slots[slot] = Attached(sandbox_id, link, policy)
            self._by_ip[link.sandbox_ip] = slot
        if old is None or _may_deny_more(old, policy):
            firewall.cut_connections(link)  # what goes straight out; what ends at the proxy is cut there
            self._cut_proxied(link.sandbox_ip)
        else:
            self._forget_upstreams(link.sandbox_ip)  # kept upstream connections were opened under the old policy

    def detach(self, slot: int, sandbox_id: str | None = None) -> None:
        """Close the slot's egress (the instance stops); its byte counts stay with the sandbox."""
        if not self.kernel or slot < 0:
            return
        attached = self._slots.get(slot)
        if sandbox_id is not None and attached is not None and attached.sandbox_id != sandbox_id:
            return  # the slot is another sandbox's by now
        if attached is None and slot in self._closed:
            return
        self._leave(slot)
        firewall.detach(slot, link_for(slot))
        self._closed.add(slot)

    def _leave(self, slot: int) -> None:
        attached = self._slots.pop(slot, None)
        if attached is None:
            return
        self._by_ip.pop(attached.link.sandbox_ip, None)
        self.resolver.memory.forget(attached.link.sandbox_ip)
        self._cut_proxied(attached.link.sandbox_ip)  # nothing of the instance that left may go on
        if attached.sandbox_id not in self._policies:
            return  # killed (forget): nothing of it is kept
        out, inn = firewall.counters().get(slot, (0, 0))
        total = self._totals.setdefault(attached.sandbox_id, [0, 0])
        total[0] += out
        total[1] += inn

    def _forget_upstreams(self, sandbox_ip: str) -> None:
        """Close the proxy's idle upstream connections of that address (egress/pool.py: never another sandbox's,
        nor one made under an older policy)."""
        if self.proxy is not None:
            self.proxy.forget(sandbox_ip)

    def _cut_proxied(self, sandbox_ip: str) -> None:
        """Reset the proxy's connections from that address and close its idle upstream ones (conntrack does not
        end them: they terminate at the proxy)."""
        if self.proxy is not None:
            self.proxy.cut_soon(sandbox_ip)

    def forget(self, sandbox_id: str) -> None:
        """A sandbox killed: nothing of it is kept."""
        self._policies.pop(sandbox_id, None)
        self._totals.pop(sandbox_id, None)
        self._hosts.pop(sandbox_id, None)

    # -- questions ------------------------------------------------------------------------------------------------
    def policy_for(self, source_ip: str) -> Policy | None:
        """The policy of the sandbox at `source_ip` (None: no attached sandbox there: refuse it)."""
        slot = self._by_ip.get(source_ip)
        return self._slots[slot].policy if slot is not None else None

    def policy_of(self, sandbox_id: str) -> Policy | None:
        return self._policies.get(sandbox_id)

    def always_denied(self, ip: str) -> bool:
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            return True
        if addr.version == 6:
            return True
        return any(addr in n for n in firewall.denied_nets(self._nets)) or is_local(ip)

    def counters(self) -> dict[str, tuple[int, int]]:
        """sandbox ID -> (bytes out, bytes in) so far: its attached slot's kernel counters, plus the slots it left
        and what the proxy counted."""
        live = firewall.counters() if self.datapath and self._slots else {}
        out: dict[str, tuple[int, int]] = {sid: (t[0], t[1]) for sid, t in self._totals.items()}
        for slot, a in self._slots.items():
            tx, rx = live.get(slot, (0, 0))
            base = out.get(a.sandbox_id, (0, 0))
            out[a.sandbox_id] = (base[0] + tx, base[1] + rx)
        return out

    def init_body(self) -> dict[str, str] | None:
        """The `network` object of the agent's /init: its resolver, and the CAs it must trust (None without egress:
        the sandbox keeps its template's settings)."""
        if not self.datapath:
            return None
        bundle = self.ca.cert_pem.decode()
        if self.config.ca_bundle is not None:
            with contextlib.suppress(OSError):
                extra = self.config.ca_bundle.read_text()
                bundle = bundle.rstrip("\n") + "\n" + extra.strip("\n") + "\n"
        return {"resolvConf": f"nameserver {GATEWAY_IP}\noptions timeout:2 attempts:2\n", "caBundle": bundle}

    # -- accounting -----------------------------------------------------------------------------------------------
    def _sandbox_at(self, source_ip: str) -> Attached | None:
        slot = self._by_ip.get(source_ip)
        return self._slots.get(slot) if slot is not None else None

    def _proxy_bytes(self, source_ip: str, up: int, down: int) -> None:
        a = self._sandbox_at(source_ip)
        if a is not None:
            total = self._totals.setdefault(a.sandbox_id, [0, 0])
            total[0] += up
            total[1] += down

    def _proxy_host(self, source_ip: str, host: str) -> None:
        self._seen(source_ip, host, "", 0)

    def _seen(self, source_ip: str, host: str, address: str, port: int) -> None:
        a = self._sandbox_at(source_ip)
        if a is None:
            return
        seen = self._hosts.setdefault(a.sandbox_id, set())
        if host in seen:
            return
        seen.add(host)
        data: dict[str, Any] = {"host": host}
        if address:
            data["address"] = address
        if port:
            data["port"] = port
        try:
            self.on_host(a.sandbox_id, data)
        except Exception as exc:  # the history is best effort here: never break egress over it
            log.warning("egress.host event for %s: %s", a.sandbox_id, exc)

    async def _watch_hosts(self) -> None:
        """Name the hosts sandboxes connect to, from the connection table (the resolver names the address)."""
        if shutil.which("conntrack") is None:
            return
        while True:
            await asyncio.sleep(HOSTS_EVERY)
            if not self._slots:
                continue
            try:
                entries = await asyncio.to_thread(_connections)
            except Exception as exc:
                log.debug("conntrack: %s", exc)
                continue
            for src, dst, port in entries:
                if dst == GATEWAY_IP or self._sandbox_at(src) is None:
                    continue
                names = self.resolver.memory.names_for(src, dst)
                self._seen(src, names[0] if names else dst, dst, port)


def _connections() -> list[tuple[str, str, int]]:
    """(sandbox address, destination, port) of every connection sandboxes opened, as the kernel tracks them."""
    proc = subprocess.run(["conntrack", "-L", "--orig-src", str(netaddr.BASE)], capture_output=True, text=True)
    out = []
    for line in proc.stdout.splitlines():
        first: dict[str, str] = {}  # the first src=, dst=, dport= of a line are the original direction's
        for kv in line.split():
            k, _, v = kv.partition("=")
            if v and k not in first:
                first[k] = v
        if first.get("src") and first.get("dst"):
            out.append((first["src"], first["dst"], int(first.get("dport", "0") or 0)))
    return out


def _may_deny_more(old: Policy, new: Policy) -> bool:
    """Whether a connection the old policy allowed may be denied by the new one (then the slot's are cut)."""
    if old == new:
        return False
    return new.denies_all or bool(new.deny_nets) or new.needs_proxy


async def _no_secret(name: str) -> str | None:
    return None
