"""Per-sandbox network namespaces reached from the host over a veth pair.

Each sandbox gets a slot N and with it a /30 of 10.88.0.0/16: the host end of the veth
holds .1, the sandbox .2. Sandboxes cannot reach each other (separate links, no
forwarding to 10.88.0.0/16), the host's services (an input filter admits only replies and the ports we
open on purpose, such as the gateway), or 169.254.169.254 (always denied): egress/firewall.py.
A TCP connection that is not allowed is refused with a reset rather than dropped (see
egress/firewall.py install_base: a half-open connection would block checkpoints). Which slot has which names and
addresses is keepstate/netaddr.py's, shared with the egress datapath.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess

from keepstate import pids
from keepstate.netaddr import BASE, GATEWAY_IP, MAX_SLOTS, Link, link_for

__all__ = ["BASE", "GATEWAY_IP", "MAX_SLOTS", "Link", "link_for"]  # the addresses, from keepstate.netaddr

SLOTS_DIR = "/run/keepstate/slots"


def claim_slot(slot: int) -> bool:
    """Claim a slot host-wide (several servers may share a host), by exclusive file creation."""
    os.makedirs(SLOTS_DIR, exist_ok=True)
    try:
        fd = os.open(f"{SLOTS_DIR}/{slot}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def record_slot_owner(slot: int, home: str, name: str) -> None:
    """Note whose sandbox holds the slot, so a server can reap sandboxes of a data directory that is gone."""
    import json

    tmp = f"{SLOTS_DIR}/.{slot}.tmp"
    with open(tmp, "w") as f:
        json.dump({"home": home, "name": name, "pid": os.getpid()}, f)
    os.replace(tmp, f"{SLOTS_DIR}/{slot}")


def orphaned_slots() -> list[tuple[int, str]]:
    """Slots whose owning data directory no longer exists: (slot, runtime name) to reap."""
    return [(slot, str(o["name"])) for slot, o in _owners()
            if not os.path.isdir(o["home"])]


def _owners() -> list[tuple[int, dict[str, str]]]:
    import json

    out: list[tuple[int, dict[str, str]]] = []
    try:
        names = os.listdir(SLOTS_DIR)
    except FileNotFoundError:
        return out
    for entry in names:
        if not entry.isdigit():
            continue
        try:
            with open(f"{SLOTS_DIR}/{entry}") as f:
                owner = json.load(f)
        except (OSError, ValueError):
            continue  # a bare claim (just being started) or unreadable: leave it
        if isinstance(owner, dict) and owner.get("home") and owner.get("name"):
            out.append((int(entry), owner))
    return out


def owned_slots(home: str) -> list[tuple[int, str]]:
    """Slots recorded for the data directory `home`: (slot, runtime name)."""
    return [(slot, str(o["name"])) for slot, o in _owners() if o["home"] == home]


def slot_owner(slot: int) -> str | None:
    """The runtime name recorded for a slot, or None (free, a bare claim, unreadable)."""
    import json

    try:
        with open(f"{SLOTS_DIR}/{slot}") as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return None
    return str(owner["name"]) if isinstance(owner, dict) and owner.get("name") else None


def slot_held(slot: int) -> bool:
    """Whether the slot is claimed: by a recorded owner, or by a process still running (a bare claim holds the
    claimer's pid until it records the owner)."""
    try:
        with open(f"{SLOTS_DIR}/{slot}") as f:
            text = f.read().strip()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return not text.isdigit() or pids.alive(int(text))


def release_slot(slot: int) -> None:
    try:
        os.unlink(f"{SLOTS_DIR}/{slot}")
    except FileNotFoundError:
        pass


def _run(*args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), input=stdin, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise OSError(f"{' '.join(args)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _batch(netns: str | None, lines: list[str], check: bool = True) -> None:
    """Run `ip` commands in one process, in `netns` if given; with check=False every line is tried (-force) and
    failures (what is already gone) are ignored."""
    _run("ip", *(["-n", netns] if netns else []), *([] if check else ["-force"]), "-batch", "-", check=check,
         stdin="\n".join(lines) + "\n")


def forget_connections(link: Link) -> None:
    """Drop the host's connection-tracking entries of the slot's addresses.

    They outlive the sandbox: a connection open when its veth went away keeps an ESTABLISHED entry for five days
    (its FIN is never sent), so every sandbox would leave some behind, filling the table (nf_conntrack_max: once
    full, new connections are dropped host-wide), and the next sandbox in the slot would inherit them.
    """
    if shutil.which("conntrack") is None:
        return  # scripts/setup-host.sh installs it
    # The slot's /30 (both its addresses) at once: each call walks the whole table, which under load takes seconds
    # (docs/design/teardown.md), so two calls rather than one per address and direction.
    net = str(ipaddress.IPv4Network(f"{link.host_ip}/30", strict=False))
    for flag in ("--orig-src", "--orig-dst"):
        _run("conntrack", "-D", flag, net, check=False)  # exits 1 when there was nothing to delete


def create(link: Link) -> None:
    """Create the namespace and veth pair; idempotent (a half-made link is rebuilt).

    Two `ip -batch` processes rather than one process a step: each process start costs 7-8 ms here and ~30 under
    load, and fifteen of them were a fifth of a restore's time. A slot is released only once its link is destroyed
    (teardowns.py), connection-tracking entries and host sockets with it, so a slot with nothing left is not
    destroyed again; one with anything of a link left (a half-made one, a dead server's) is.
    """
    if leftover(link):
        destroy(link)  # and with it the last sandbox's connection-tracking entries
    _batch(None, [
        f"netns add {link.netns}",
        # The peer is made inside the namespace under its final name.
        f"link add {link.host_if} type veth peer name eth0 netns {link.netns}",
        f"addr add {link.host_ip}/30 dev {link.host_if}",
        f"link set {link.host_if} up",
    ])
    _batch(link.netns, ["link set lo up", "link set eth0 up", f"addr replace {link.sandbox_ip}/30 dev eth0",
                        f"route replace default via {link.host_ip} dev eth0"])


def leftover(link: Link) -> bool:
    """Whether anything of the slot's link exists: its namespace's file or the host's end of its veth."""
    return os.path.exists(link.netns_path) or has_interface(link.host_if)


def destroy(link: Link) -> None:
    _batch(None, [f"link del {link.host_if}", f"netns del {link.netns}"], check=False)
    forget_sockets(link)
    forget_connections(link)


def forget_sockets(link: Link) -> None:
    """Destroy the host's TCP sockets to the slot's sandbox address (`ss -K`, SOCK_DESTROY).

    A connection the host closed while its sandbox was dying (a relay's keep-alive pool closed on kill) is left in
    FIN_WAIT1, retransmitting its FIN into the slot's address for minutes; the next sandbox in the slot would get
    those segments, and a checkpoint of it would count the socket as a connection open into it.
    """
    _run("ss", "-K", "-t", "dst", link.sandbox_ip, check=False)


def has_interface(name: str) -> bool:
    """Whether this network namespace has the interface. Not /sys/class/net: sysfs shows the namespace of whoever
    mounted it (the host's), not ours when the server runs in a namespace of its own (the tests' isolated one)."""
    try:
        with open("/proc/self/net/dev") as f:
            return any(line.split(":", 1)[0].strip() == name for line in f.readlines()[2:])
    except OSError:
        return False


def exists(link: Link) -> bool:
    return _run("ip", "netns", "pids", link.netns, check=False).returncode == 0
