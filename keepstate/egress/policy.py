"""A sandbox's network policy: parsed from E2B's wire shape, validated, stored, and asked questions.

The wire (create's `network` and `allow_internet_access`, `PUT /sandboxes/{id}/network`) is E2B's
(shared/docs/e2b-protocol-more.md sections 2-4); docs/design/network.md says how the datapath enforces it.
Allow beats deny: a destination an `allowOut` entry names is reachable even when a `denyOut` entry covers it.
A policy is immutable; an update builds a new one and replaces the old whole (omitted fields are cleared).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any

from keepstate.errors import BadRequest

Net = ipaddress.IPv4Network | ipaddress.IPv6Network
ALL_TRAFFIC = "0.0.0.0/0"
# A secret's name as keepstate/secret/store.py allows it: no whitespace, braces or URL delimiters.
SECRET_REF = re.compile(r"\$\{e2b\.secrets\.([^{}\s/?#%\\]+)\}")
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
CREATE_FIELDS = {"allowOut", "denyOut", "rules", "egressProxy", "allowPublicTraffic", "maskRequestHost",
                 "httpsPorts", "dnsServers"}
UPDATE_FIELDS = {"allowOut", "denyOut", "rules", "egressProxy", "dnsServers", "allow_internet_access",
                 "allowInternetAccess"}
MAX_DNS_SERVERS = 10
MAX_ENTRIES = 1000


@dataclass(frozen=True)
class EgressProxy:
    """A SOCKS5 upstream (RFC 1928, with RFC 1929 credentials when a username is given)."""

    host: str
    port: int
    username: str | None = None
    password: str | None = None

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class HeaderRule:
    """Headers the egress proxy sets on each request to one host; values may hold `${e2b.secrets.NAME}`."""

    headers: tuple[tuple[str, str], ...]

    def secret_names(self) -> set[str]:
        return {m.group(1).lower() for _, v in self.headers for m in SECRET_REF.finditer(v)}


@dataclass(frozen=True)
class Policy:
    allow_internet_access: bool = True
    allow_nets: tuple[Net, ...] = ()
    allow_domains: tuple[str, ...] = ()  # lower-case; "*.example.com" matches its subdomains, not itself
    deny_nets: tuple[Net, ...] = ()
    rules: tuple[tuple[str, tuple[HeaderRule, ...]], ...] = ()  # (host, rules), host lower-case
    egress_proxy: EgressProxy | None = None
    allow_public_traffic: bool = True
    mask_request_host: str | None = None
    https_ports: tuple[int, ...] = ()
    # `dnsServers`: addresses opened (all traffic) when `allowOut` names a domain, as E2B does. None: E2B's default
    # would be 8.8.8.8; here the default resolver is the server's own (GATEWAY_IP), always reachable, so none.
    dns_servers: tuple[str, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)  # reserved

    # --- questions the datapath asks -------------------------------------------------------------------------

    @property
    def denies_all(self) -> bool:
        """Nothing goes out unless an allow entry names it (`allow_internet_access: false` or a deny of
        0.0.0.0/0)."""
        return not self.allow_internet_access or any(n.prefixlen == 0 for n in self.deny_nets)

    @property
    def open_nets(self) -> tuple[Net, ...]:
        """What the policy lets through by address: `allowOut`'s nets, and `dnsServers` when a domain is allowed."""
        if not self.allow_domains or not self.dns_servers:
            return self.allow_nets
        return self.allow_nets + tuple(ipaddress.ip_network(d) for d in self.dns_servers)

    @property
    def needs_proxy(self) -> bool:
        """Whether some TCP must pass through the egress proxy (a decision on names, a header rule, an upstream):
        otherwise the kernel decides on addresses alone."""
        return bool(self.allow_domains or self.rules or self.egress_proxy)

    def ip_verdict(self, ip: str) -> str:
        """"allow", "deny" or "name" (denied by address but an allowed domain may still match it by SNI/Host)."""
        addr = ipaddress.ip_address(ip)
        if any(addr in n for n in self.open_nets):
            return "allow"
        denied = self.denies_all or any(addr in n for n in self.deny_nets)
        if not denied:
            return "allow"
        return "name" if self.allow_domains else "deny"

    def domain_allowed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(_matches(d, host) for d in self.allow_domains)

    def rules_for(self, host: str) -> tuple[HeaderRule, ...]:
        host = host.lower().rstrip(".")
        for h, rs in self.rules:
            if _matches(h, host):
                return rs
        return ()

    def secret_names(self) -> set[str]:
        return {n for _, rs in self.rules for r in rs for n in r.secret_names()}

    # --- the wire and the record -----------------------------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        """What `GET /sandboxes/{id}` shows under `network` (the proxy's password stripped)."""
        out: dict[str, Any] = {
            "allowOut": [_show(n) for n in self.allow_nets] + list(self.allow_domains),
            "denyOut": [_show(n) for n in self.deny_nets],
            "allowPublicTraffic": self.allow_public_traffic,
        }
        if self.rules:
            out["rules"] = {h: [{"transform": {"headers": dict(r.headers)}} for r in rs] for h, rs in self.rules}
        if self.egress_proxy:
            out["egressProxy"] = {"address": self.egress_proxy.address}
            if self.egress_proxy.username is not None:
                out["egressProxy"]["username"] = self.egress_proxy.username
        if self.mask_request_host is not None:
            out["maskRequestHost"] = self.mask_request_host
        if self.https_ports:
            out["httpsPorts"] = list(self.https_ports)
        if self.dns_servers is not None:
            out["dnsServers"] = list(self.dns_servers)
        return out

    def to_json(self) -> dict[str, Any]:
        """The stored form (the sandbox's record; password kept: the proxy needs it after a restart)."""
        out = self.to_wire()
        out["allowInternetAccess"] = self.allow_internet_access
        if self.egress_proxy and self.egress_proxy.password is not None:
            out["egressProxy"]["password"] = self.egress_proxy.password
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> Policy:
        if not d:
            return cls()
        body = {k: v for k, v in d.items() if k != "allowInternetAccess"}
        return parse(body, allow_internet_access=d.get("allowInternetAccess", True), fields=None)

    def updated(self, body: Any) -> Policy:
        """`PUT /sandboxes/{id}/network`: the egress part replaced whole; the inbound part (public traffic, the
        host mask, HTTPS ports) is kept, as E2B does."""
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        unknown = set(body) - UPDATE_FIELDS
        if unknown:
            raise BadRequest(f"unknown field(s) in the network update: {', '.join(sorted(unknown))}; "
                             f"allowed: {', '.join(sorted(UPDATE_FIELDS))}")
        aia = body.get("allow_internet_access", body.get("allowInternetAccess", True))
        egress = {k: v for k, v in body.items() if k in CREATE_FIELDS}
        new = parse(egress, allow_internet_access=aia, fields=CREATE_FIELDS)
        return Policy(allow_internet_access=new.allow_internet_access, allow_nets=new.allow_nets,
                      allow_domains=new.allow_domains, deny_nets=new.deny_nets, rules=new.rules,
                      egress_proxy=new.egress_proxy, dns_servers=new.dns_servers,
                      allow_public_traffic=self.allow_public_traffic,
                      mask_request_host=self.mask_request_host, https_ports=self.https_ports)


def _matches(pattern: str, host: str) -> bool:
    """A lower-case domain pattern against a lower-case host: "*.example.com" matches its subdomains, not itself."""
    if pattern.startswith("*."):
        return host.endswith(pattern[1:]) and host != pattern[2:]
    return host == pattern


def _show(n: Net) -> str:
    return str(n.network_address) if n.prefixlen == n.max_prefixlen else str(n)


def _net(entry: str, where: str) -> Net:
    try:
        return ipaddress.ip_network(entry, strict=False)
    except ValueError:
        raise BadRequest(f"`{where}`: {entry!r} is not an IP address or CIDR block") from None


def _domain(entry: str, where: str) -> str:
    d = entry.strip().lower().rstrip(".")
    body = d[2:] if d.startswith("*.") else d
    labels = body.split(".")
    if len(labels) < 2 or not all(_LABEL.match(x) for x in labels) or labels[-1].isdigit():
        raise BadRequest(f"`{where}`: {entry!r} is not an IP address, CIDR block or domain "
                         f"(a domain may start with `*.`)")
    return d


def _looks_ip(entry: str) -> bool:
    return bool(re.fullmatch(r"[0-9a-fA-F:.]+(/\d+)?", entry)) and any(c in entry for c in ".:")


def _str_list(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise BadRequest(f"`{where}` must be a list of strings")
    if len(value) > MAX_ENTRIES:
        raise BadRequest(f"`{where}` holds {len(value)} entries; at most {MAX_ENTRIES} are allowed")
    return [x.strip() for x in value]


def _proxy(value: Any) -> EgressProxy | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("address"), str):
        raise BadRequest("`network.egressProxy` must be an object with a string `address` (host:port)")
    unknown = set(value) - {"address", "username", "password"}
    if unknown:
        raise BadRequest(f"`network.egressProxy`: unknown field(s) {', '.join(sorted(unknown))}")
    addr = value["address"].strip()
    m = re.fullmatch(r"\[([0-9a-fA-F:.]+)\]:(\d{1,5})|([^:\s\[\]]+):(\d{1,5})", addr)
    if not m:
        raise BadRequest(f"`network.egressProxy.address`: {addr!r} is not host:port")
    host, port = (m.group(1), int(m.group(2))) if m.group(1) else (m.group(3), int(m.group(4)))
    if not 1 <= port <= 65535:
        raise BadRequest(f"`network.egressProxy.address`: port {port} is outside 1-65535")
    user, pw = value.get("username"), value.get("password")
    for name, v in (("username", user), ("password", pw)):
        if v is not None and (not isinstance(v, str) or not 1 <= len(v.encode()) <= 255):
            raise BadRequest(f"`network.egressProxy.{name}` must be a string of 1 to 255 bytes")
    if pw is not None and user is None:
        raise BadRequest("`network.egressProxy.password` is only valid together with `username`")
    return EgressProxy(host=host.lower(), port=port, username=user, password=pw)


def _rules(value: Any) -> tuple[tuple[str, tuple[HeaderRule, ...]], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise BadRequest("`network.rules` must be an object of host: [rule, ...]")
    out = []
    for host, rules in value.items():
        h = _domain(host, "network.rules") if not _looks_ip(host) else str(_net(host, "network.rules").network_address)
        if not isinstance(rules, list):
            raise BadRequest(f"`network.rules[{host!r}]` must be a list of rules")
        parsed = []
        for r in rules:
            if not isinstance(r, dict) or set(r) - {"transform"}:
                raise BadRequest(f"`network.rules[{host!r}]`: a rule is an object with only `transform`")
            t = r.get("transform") or {}
            if not isinstance(t, dict) or set(t) - {"headers"}:
                raise BadRequest(f"`network.rules[{host!r}]`: a transform is an object with only `headers`")
            headers = t.get("headers") or {}
            if not isinstance(headers, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) and re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", k)
                    and not any(c in v for c in "\r\n\0") for k, v in headers.items()):
                raise BadRequest(f"`network.rules[{host!r}]`: `headers` must map header names to values "
                                 f"(no CR, LF or NUL)")
            parsed.append(HeaderRule(headers=tuple(headers.items())))
        out.append((h, tuple(parsed)))
    return tuple(out)


def parse(body: Any, *, allow_internet_access: Any = True, fields: set[str] | None = CREATE_FIELDS) -> Policy:
    """Create's `network` object (None or {} for the default) with its `allow_internet_access`."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise BadRequest("`network` must be an object")
    if fields is not None:
        unknown = set(body) - fields
        if unknown:
            raise BadRequest(f"unknown field(s) in `network`: {', '.join(sorted(unknown))}; "
                             f"allowed: {', '.join(sorted(fields))}")
    if allow_internet_access is None:
        allow_internet_access = True
    if not isinstance(allow_internet_access, bool):
        raise BadRequest("`allow_internet_access` must be a boolean")
    allow_nets: list[Net] = []
    allow_domains: list[str] = []
    for e in _str_list(body.get("allowOut"), "network.allowOut"):
        if _looks_ip(e):
            allow_nets.append(_net(e, "network.allowOut"))
        else:
            allow_domains.append(_domain(e, "network.allowOut"))
    deny_nets = []
    for e in _str_list(body.get("denyOut"), "network.denyOut"):
        if not _looks_ip(e):
            raise BadRequest(f"`network.denyOut`: {e!r} is not an IP address or CIDR block "
                             f"(denyOut takes addresses only; domains go in allowOut)")
        deny_nets.append(_net(e, "network.denyOut"))
    rules = _rules(body.get("rules"))
    probe = Policy(allow_internet_access=allow_internet_access, allow_nets=tuple(allow_nets),
                   allow_domains=tuple(allow_domains), deny_nets=tuple(deny_nets))
    for host, _ in rules:
        reachable = (probe.domain_allowed(host) if not _looks_ip(host) else probe.ip_verdict(host) == "allow")
        if not reachable and probe.denies_all:
            raise BadRequest(f"`network.rules` names {host!r}, which the policy does not allow: a rule does not "
                             f"allow a host; add it to `allowOut`")
    apt = body.get("allowPublicTraffic", True)
    if not isinstance(apt, bool):
        raise BadRequest("`network.allowPublicTraffic` must be a boolean")
    mask = body.get("maskRequestHost")
    if mask is not None and (not isinstance(mask, str) or not mask.strip() or any(c in mask for c in " \r\n\0/")):
        raise BadRequest("`network.maskRequestHost` must be a host name (it may hold ${PORT})")
    ports = body.get("httpsPorts") or []
    if not isinstance(ports, list) or not all(isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= 65535
                                              for p in ports):
        raise BadRequest("`network.httpsPorts` must be a list of port numbers")
    return Policy(allow_internet_access=allow_internet_access, allow_nets=tuple(allow_nets),
                  allow_domains=tuple(allow_domains), deny_nets=tuple(deny_nets), rules=rules,
                  egress_proxy=_proxy(body.get("egressProxy")), allow_public_traffic=apt,
                  mask_request_host=mask, https_ports=tuple(ports), dns_servers=_dns(body.get("dnsServers")))


def _dns(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    where = "network.dnsServers"
    entries = _str_list(value, where)
    if len(entries) > MAX_DNS_SERVERS:
        raise BadRequest(f"`{where}` holds {len(entries)} entries; at most {MAX_DNS_SERVERS} are allowed")
    for e in entries:
        try:
            if not isinstance(ipaddress.ip_address(e), ipaddress.IPv4Address):
                raise ValueError
        except ValueError:
            raise BadRequest(f"`{where}`: {e!r} is not an IPv4 address") from None
    return tuple(entries)
