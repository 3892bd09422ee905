"""The egress datapath's nft scripts are pure: each policy shape renders the rules the design names. A root test
applies them in a namespace of its own, so the kernel's nft accepts exactly what render_slot writes."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import uuid

import pytest

from keepstate.egress import firewall as fw
from keepstate.egress import policy
from keepstate.errors import BadRequest
from keepstate.netaddr import link_for

LINK = link_for(7)
PORTS = fw.Ports(dns=5300, proxy=None)
LIMITS = fw.Limits(max_connections=1024, rate_mbit=0)


def rules(script: str, chain: str) -> list[str]:
    prefix = f"add rule inet keepstate {chain} "
    return [ln[len(prefix):] for ln in script.splitlines() if ln.startswith(prefix)]


def render(body: dict | None = None, aia: bool = True, ports: fw.Ports = PORTS, limits: fw.Limits = LIMITS,
           private: tuple[str, ...] = ()) -> str:
    return fw.render_slot(7, LINK, policy.parse(body, allow_internet_access=aia), ports, limits,
                          [ipaddress.ip_network(p) for p in private])


def test_default_policy_accepts_all_but_the_always_denied() -> None:
    s = render()
    fwd = rules(s, "fwd_7")
    assert fwd[-1] == "accept"
    denied = [r for r in fwd if r.startswith("ip daddr {") and "reject" in r]
    assert denied and "169.254.0.0/16" in denied[0] and "10.0.0.0/8" in denied[0] and "127.0.0.0/8" in denied[0]
    assert fwd.index(denied[0]) < len(fwd) - 1
    assert rules(s, "pre_7") == ["ip daddr 10.88.255.254 meta l4proto { tcp, udp } th dport 53 dnat ip to "
                                 "10.88.255.254:5300"]
    assert 'add element inet keepstate slot_fwd { "ksv7" : jump fwd_7 }' in s
    assert 'add element inet keepstate slot_pre { "ksv7" : jump pre_7 }' in s
    assert 'counter name "tx_7"' in fwd and any('counter name "rx_7"' in r for r in fwd)
    assert "flush chain inet keepstate fwd_7" in s  # replaced whole, in the one transaction
    assert not any(" drop" in r and "limit" not in r for r in fwd)  # rejected, never dropped


def test_deny_all_rejects_everything_not_allowed() -> None:
    for s in (render(aia=False), render({"denyOut": ["0.0.0.0/0"]})):
        fwd = rules(s, "fwd_7")
        assert fwd[-2:] == ["meta l4proto tcp reject with tcp reset", "reject with icmpx admin-prohibited"]
        assert "accept" not in fwd


def test_allow_one_ip_and_deny_all() -> None:
    fwd = rules(render({"allowOut": ["203.0.113.7"], "denyOut": ["0.0.0.0/0"]}), "fwd_7")
    allow = fwd.index("ip daddr { 203.0.113.7/32 } accept")
    assert fwd[allow + 1:] == ["meta l4proto tcp reject with tcp reset", "reject with icmpx admin-prohibited"]
    # the always-denied set comes first: an allow entry never opens them
    assert fwd.index(next(r for r in fwd if "169.254.0.0/16" in r)) < allow
    bad = rules(render({"allowOut": ["169.254.169.254"], "denyOut": ["0.0.0.0/0"]}), "fwd_7")
    assert bad.index(next(r for r in bad if "169.254.0.0/16" in r)) < bad.index("ip daddr { 169.254.169.254/32 } "
                                                                                 "accept")


def test_deny_one_ip_accepts_the_rest() -> None:
    fwd = rules(render({"denyOut": ["198.51.100.9"]}), "fwd_7")
    assert fwd[-3:] == ["ip daddr { 198.51.100.9/32 } meta l4proto tcp reject with tcp reset",
                        "ip daddr { 198.51.100.9/32 } reject with icmpx admin-prohibited", "accept"]


def test_domain_allow_goes_through_the_proxy_when_there_is_one() -> None:
    body = {"allowOut": ["plain.test"], "denyOut": ["0.0.0.0/0"]}
    pre = rules(render(body, ports=fw.Ports(5300, 8443)), "pre_7")
    assert pre[-1] == "meta l4proto tcp dnat ip to 10.88.255.254:8443"
    assert "169.254.0.0/16" in pre[-3] and pre[-3].endswith("return")  # never handed to the proxy
    assert pre[-2] == "fib daddr type local return"  # nor the host's own addresses: `input` refuses them
    # without a proxy, the names cannot be checked: the kernel rejects (fail closed)
    no_proxy = render(body)
    assert len(rules(no_proxy, "pre_7")) == 1 and rules(no_proxy, "fwd_7")[-1].startswith("reject")


def test_limits_and_private_exemptions() -> None:
    s = render(limits=fw.Limits(max_connections=10, rate_mbit=8), private=("192.168.5.0/24", "10.88.0.0/24"))
    fwd = rules(s, "fwd_7")
    assert "ct state new ct count over 10 meta l4proto tcp reject with tcp reset" in fwd
    assert sum("limit rate over 1000000 bytes/second" in r for r in fwd) == 2  # out and in
    assert all("ct state established" in r for r in fwd if "limit rate" in r)  # a handshake is never dropped
    nets = fw.denied_nets([ipaddress.ip_network("192.168.5.0/24"), ipaddress.ip_network("10.88.0.0/24")])
    assert not any(ipaddress.ip_address("192.168.5.3") in n for n in nets)
    assert any(ipaddress.ip_address("192.168.6.3") in n for n in nets)
    assert any(ipaddress.ip_address("10.88.0.5") in n for n in nets)  # sandboxes' own range: never exempt
    unlimited = rules(render(limits=fw.Limits(0, 0)), "fwd_7")
    assert not any("ct count" in r or "limit rate" in r for r in unlimited)


def test_detach_script_is_idempotent_by_construction() -> None:
    s = fw.render_detach(7, LINK)
    assert s.index("add chain inet keepstate fwd_7") < s.index("delete chain inet keepstate fwd_7")
    assert s.index('delete element inet keepstate slot_fwd { "ksv7" }') < s.index("delete chain inet keepstate "
                                                                                  "fwd_7")


@pytest.fixture
def netns(monkeypatch: pytest.MonkeyPatch):
    if os.geteuid() != 0 or shutil.which("nft") is None:
        pytest.skip("needs root and nft")
    name = f"kse-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    monkeypatch.setattr(fw, "NFT", ["nsenter", f"--net=/run/netns/{name}", "nft"])
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_the_kernel_takes_every_script(netns: str) -> None:
    fw.ensure_base((49983,))
    fw.ensure_base((49983,))  # idempotent: a second server on the host
    shapes = [({}, True), ({}, False), ({"allowOut": ["203.0.113.7"], "denyOut": ["0.0.0.0/0"]}, True),
              ({"denyOut": ["198.51.100.9"]}, True), ({"allowOut": ["*.plain.test"], "denyOut": ["0.0.0.0/0"]}, True)]
    for body, aia in shapes:
        fw.apply(7, LINK, policy.parse(body, allow_internet_access=aia), fw.Ports(5300, 8443),
                 fw.Limits(10, 8), [ipaddress.ip_network("192.168.5.0/24")])
    fw.apply(8, link_for(8), policy.Policy(), PORTS, LIMITS)
    assert set(fw.counters()) == {7, 8}
    fw.detach(8, link_for(8))
    fw.detach(8, link_for(8))
    assert set(fw.counters()) == {7}
    listing = subprocess.run([*fw.NFT, "list", "table", "inet", "keepstate"], capture_output=True, text=True,
                             check=True).stdout
    assert "fwd_8" not in listing and '"ksv7" : jump fwd_7' in listing


def test_dns_servers_are_opened_only_beside_an_allowed_domain() -> None:
    from keepstate.egress.policy import parse

    with_domain = parse({"allowOut": ["plain.test"], "denyOut": ["0.0.0.0/0"], "dnsServers": ["198.51.100.53"]})
    assert with_domain.ip_verdict("198.51.100.53") == "allow" and with_domain.ip_verdict("198.51.100.54") == "name"
    assert "198.51.100.53" in " ".join(rules(render({"allowOut": ["plain.test"], "denyOut": ["0.0.0.0/0"],
                                                     "dnsServers": ["198.51.100.53"]}), "fwd_7"))
    no_domain = parse({"denyOut": ["0.0.0.0/0"], "dnsServers": ["198.51.100.53"]})
    assert no_domain.ip_verdict("198.51.100.53") == "deny"
    assert with_domain.to_wire()["dnsServers"] == ["198.51.100.53"]
    for bad in (["::1"], ["not-an-ip"], ["198.51.100.1"] * 11, "198.51.100.1"):
        with pytest.raises(BadRequest):
            parse({"dnsServers": bad})
