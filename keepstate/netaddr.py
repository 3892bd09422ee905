"""Where sandboxes sit on the host's network: each slot N has a /30 of 10.88.0.0/16 (the host end of its veth .1,
the sandbox .2), a network namespace and an interface named for N; GATEWAY_IP is the one address every sandbox
reaches the host's services on. Shared by the runtime (runtime/network.py makes the links) and the egress datapath
(egress/firewall.py filters them); it imports neither.
"""

from __future__ import annotations

import ipaddress
import subprocess
from dataclasses import dataclass

BASE = ipaddress.IPv4Network("10.88.0.0/16")
# The last /30 is not a slot: its .254 is the metering gateway's fixed address, the same for every
# sandbox (on the host's loopback), so a base URL in a sandbox stays valid across restores and forks.
MAX_SLOTS = BASE.num_addresses // 4 - 1
GATEWAY_IP = str(BASE.broadcast_address - 1)


@dataclass(frozen=True)
class Link:
    slot: int
    netns: str
    host_if: str
    host_ip: str
    sandbox_ip: str

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"


def link_for(slot: int) -> Link:
    """The names and addresses of slot N: pure, so the same slot always means the same link."""
    if not 0 <= slot < MAX_SLOTS:
        raise ValueError(f"slot {slot} outside 0..{MAX_SLOTS - 1}")
    net = int(BASE.network_address) + slot * 4
    return Link(
        slot=slot,
        netns=f"ks{slot}",
        host_if=f"ksv{slot}",
        host_ip=str(ipaddress.IPv4Address(net + 1)),
        sandbox_ip=str(ipaddress.IPv4Address(net + 2)),
    )


def ensure_gateway_address() -> None:
    """Put GATEWAY_IP on the host's loopback so sandboxes reach it through their own veth."""
    shown = subprocess.run(["ip", "-4", "addr", "show", "dev", "lo"], capture_output=True, text=True, check=True)
    if GATEWAY_IP not in shown.stdout:
        proc = subprocess.run(["ip", "addr", "add", f"{GATEWAY_IP}/32", "dev", "lo"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise OSError(f"ip addr add {GATEWAY_IP}/32 dev lo failed: {proc.stderr.strip()}")
