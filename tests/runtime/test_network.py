"""Slot addressing and the OCI spec are pure: same input, same result, no runsc needed."""

from __future__ import annotations

import errno
import ipaddress
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from keepstate.runtime import network
from keepstate.runtime.base import Limits, Mount, SandboxSpec, TemplateRoot
from keepstate.runtime.gvisor import oci_spec


def test_slots_are_disjoint_30s_and_avoid_the_gateway_address() -> None:
    seen = set()
    for slot in (0, 1, 2, 63, 64, network.MAX_SLOTS - 1):
        link = network.link_for(slot)
        net = ipaddress.ip_network(f"{link.host_ip}/30", strict=False)
        assert ipaddress.ip_address(link.sandbox_ip) in net and net not in seen
        seen.add(net)
        assert network.GATEWAY_IP not in (link.host_ip, link.sandbox_ip)
    with pytest.raises(ValueError):
        network.link_for(network.MAX_SLOTS)
    assert ipaddress.ip_address(network.GATEWAY_IP) in network.BASE


def test_oci_spec_limits_namespace_and_readonly_lib() -> None:
    link = network.link_for(5)
    spec = SandboxSpec(name="ks-x", template=TemplateRoot("base", "d", Path("/r")), limits=Limits(1.5, 256, 99))
    doc = oci_spec(spec, link, Path("/lib/keepstate"), Path("/rt/abc"))
    res = doc["linux"]["resources"]
    assert res["memory"]["limit"] == 256 << 20 and res["cpu"]["quota"] == 150_000 and res["pids"]["limit"] == 99
    assert res["cpu"]["shares"] == 1536  # 1024 per CPU: under contention each sandbox gets its limit's share
    assert {"type": "network", "path": "/run/netns/ks5"} in doc["linux"]["namespaces"]
    lib = [m for m in doc["mounts"] if m["destination"] == "/opt/keepstate/lib/keepstate"][0]
    assert "ro" in lib["options"]
    # the agent and its PID 1 come from the agent runtime, mounted read-only (docs/design/agent-runtime.md)
    assert {"destination": "/opt/keepstate/rt", "type": "bind", "source": "/rt/abc",
            "options": ["rbind", "ro"]} in doc["mounts"]
    assert doc["process"]["args"][0] == "/opt/keepstate/rt/bin/tini"
    assert doc["process"]["args"][4:9] == ["/opt/keepstate/rt/lib/ld-linux-x86-64.so.2", "--inhibit-cache",
                                           "--library-path", "/opt/keepstate/rt/lib", "/opt/keepstate/rt/bin/python3"]


def test_oci_spec_cpu_shares_follow_the_cpu_limit() -> None:
    link = network.link_for(5)
    for cpu, shares in ((0.5, 512), (1, 1024), (2, 2048), (4, 4096)):
        spec = SandboxSpec(name="ks-x", template=TemplateRoot("base", "d", Path("/r")), limits=Limits(cpu, 256))
        assert oci_spec(spec, link, Path("/l"), Path("/rt"))["linux"]["resources"]["cpu"]["shares"] == shares


def test_oci_spec_bind_mounts_volumes_read_write() -> None:
    link = network.link_for(5)
    spec = SandboxSpec(name="ks-x", template=TemplateRoot("base", "d", Path("/r")), limits=Limits(),
                       mounts=(Mount(Path("/home/v/fs/data"), "/mnt/data"),))
    doc = oci_spec(spec, link, Path("/lib/keepstate"), Path("/rt/abc"))
    # at a mount point every build has (never one runsc would make in the template's directory); the agent
    # bind-mounts it at the path asked for
    assert {"destination": "/opt/keepstate/volumes/0", "type": "bind", "source": "/home/v/fs/data",
            "options": ["rbind", "rw"]} in doc["mounts"]
    assert 'KEEPSTATE_VOLUME_MOUNTS=[["/opt/keepstate/volumes/0", "/mnt/data"]]' in doc["process"]["env"]
    plain = oci_spec(SandboxSpec(name="ks-y", template=spec.template, limits=Limits()), link, Path("/l"), Path("/rt"))
    assert len(doc["mounts"]) == len(plain["mounts"]) + 1


def test_slot_claims_record_their_owner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reaper compares the recorded owner with the sandbox it reaps: a slot claimed since is not torn down."""
    monkeypatch.setattr(network, "SLOTS_DIR", str(tmp_path / "slots"))
    assert network.claim_slot(7)
    assert not network.claim_slot(7)  # host-wide exclusive
    assert network.slot_owner(7) is None  # a bare claim names nobody yet
    network.record_slot_owner(7, str(tmp_path), "ks-one")
    assert network.slot_owner(7) == "ks-one"
    network.release_slot(7)
    assert network.slot_owner(7) is None
    assert network.claim_slot(7)
    home = tmp_path / "home"  # not made yet: a data directory that is gone
    network.record_slot_owner(7, str(home), "ks-two")
    assert network.slot_owner(7) == "ks-two"
    assert network.orphaned_slots() == [(7, "ks-two")]  # its data directory is gone: nobody will adopt it
    home.mkdir()  # a data directory that exists is alive, database file or not
    assert network.orphaned_slots() == []


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("conntrack") is None, reason="needs root and conntrack")
def test_a_slots_link_forgets_its_last_sandboxs_connections() -> None:
    """Connection-tracking entries outlive a sandbox (an ESTABLISHED one for five days); destroying a slot's link
    drops its own, and only its own, so the slot's next sandbox inherits none."""
    slot = next(n for n in range(network.MAX_SLOTS - 1, 1, -1) if network.claim_slot(n))
    link = network.link_for(slot)
    other = network.link_for(slot - 1)
    try:
        network.create(link)
        entries = []
        for lk, port in ((link, 40123), (other, 40124)):
            entry = ["-p", "tcp", "-s", lk.host_ip, "-d", lk.sandbox_ip, "--sport", str(port), "--dport", "49983"]
            subprocess.run(["conntrack", "-I", *entry, "--state", "ESTABLISHED", "-t", "600", "-u", "ASSURED"],
                           check=True, capture_output=True)
            entries.append(entry)

        def tracked(entry: list[str]) -> bool:
            return subprocess.run(["conntrack", "-L", *entry], capture_output=True, text=True).stdout.strip() != ""

        assert tracked(entries[0]) and tracked(entries[1])
        network.destroy(link)
        assert not network.leftover(link)
        assert not tracked(entries[0])  # this slot's: gone
        assert tracked(entries[1])  # another slot's: left alone
    finally:
        network.destroy(link)
        network.release_slot(slot)
        subprocess.run(["conntrack", "-D", "-s", other.host_ip, "-d", other.sandbox_ip], capture_output=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
@pytest.mark.parametrize("left", ["nothing", "namespace", "veth", "whole link"])
def test_a_slots_link_is_made_whatever_its_last_one_left(left: str) -> None:
    """A slot's link is made in two `ip -batch` runs; what a half-made or undestroyed link left is destroyed first.
    The result is the same every time: the sandbox's end is eth0 in the namespace with the slot's address and a
    default route through the host's end, which is up with the host's address."""
    slot = next(n for n in range(network.MAX_SLOTS - 1, 1, -1) if network.claim_slot(n))
    link = network.link_for(slot)

    def ip(*args: str) -> str:
        return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout

    try:
        if left == "namespace":
            ip("netns", "add", link.netns)
        elif left == "veth":
            ip("link", "add", link.host_if, "type", "veth", "peer", "name", f"ksp{slot}")
        elif left == "whole link":
            network.create(link)
        assert network.leftover(link) == (left != "nothing")
        network.create(link)
        assert f"inet {link.host_ip}/30" in ip("-4", "addr", "show", "dev", link.host_if)
        assert "state UP" in ip("link", "show", link.host_if) or "LOWER_UP" in ip("link", "show", link.host_if)
        inside = ip("-n", link.netns, "-4", "addr", "show", "dev", "eth0")
        assert f"inet {link.sandbox_ip}/30" in inside
        assert f"default via {link.host_ip} dev eth0" in ip("-n", link.netns, "route")
        assert "UP" in ip("-n", link.netns, "link", "show", "lo")
        network.destroy(link)
        assert not network.leftover(link)
        assert f"ksp{slot}" not in ip("link")
    finally:
        network.destroy(link)
        network.release_slot(slot)


def test_a_bare_claim_is_held_while_its_claimer_lives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(network, "SLOTS_DIR", str(tmp_path / "slots"))
    assert not network.slot_held(9)  # free
    assert network.claim_slot(9)
    assert network.slot_held(9) and network.slot_owner(9) is None  # ours, being set up: held, not yet named
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / "slots" / "9").write_text(str(dead.pid))  # claimed by a process that died before naming it
    assert not network.slot_held(9)
    network.record_slot_owner(9, str(tmp_path), "ks-nine")
    assert network.slot_held(9) and network.slot_owner(9) == "ks-nine"


def test_a_slots_link_destroys_the_hosts_sockets_to_its_last_sandbox() -> None:
    """A host socket left retransmitting into a slot's address (its sandbox gone mid-connection) is destroyed when
    the slot's link is made again, so the next sandbox there inherits no connection."""
    slot = next(n for n in range(network.MAX_SLOTS - 1, 1, -1) if network.claim_slot(n))
    link = network.link_for(slot)
    sock = socket.socket()
    try:
        network.create(link)
        # Nothing answers in the namespace: the host's connect stays in SYN_SENT, retrying.
        subprocess.run(["nsenter", f"--net={link.netns_path}", "iptables", "-w", "-A", "INPUT", "-p", "tcp", "-j",
                        "DROP"], check=True, capture_output=True)
        sock.setblocking(False)
        assert sock.connect_ex((link.sandbox_ip, 49983)) == errno.EINPROGRESS
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0  # still trying
        network.create(link)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNABORTED
    finally:
        sock.close()
        network.destroy(link)
        network.release_slot(slot)
