"""A fake internet for tests and benchmarks: a network namespace holding the "internet" addresses and its servers.

The test run lives in a network namespace of its own (`scripts/isolated.sh`: loopback only). `FakeInternet.up()`
adds a namespace `ksfi-<tag>` and a veth pair to it (ours `ksfi0` 203.0.113.1/30, its end 203.0.113.2/30), and
makes that the current namespace's default route: the only way out, into a namespace that has no route anywhere
else (an `unreachable` default), so a wrong rule in the code under test can reach nothing real. `up()` refuses to
run in the host's root namespace, where it would change the machine's own routes.

Inside: the site addresses on loopback (198.51.100.10-.30, .53, .80, 203.0.113.50), and, in two child processes
started through `nsenter --net` (not `ip netns exec`, which remounts /sys):
- DNS on 198.51.100.53:53 (UDP, TCP): A records from `names` (NXDOMAIN otherwise);
- HTTP :80 and HTTPS :443 at every site address (`internet_http`), leaves from a test CA whose PEM is `ca_file`;
- SOCKS5 on 198.51.100.80:1080 (no auth) and :1081 (user `u`, password `p`), its CONNECT log and the DNS query
  log at `http://198.51.100.80:8080/log` and `/dns-log`;
- the bulk server on 203.0.113.50:9000 (`internet_bulk`).

`python -m keepstate.testing.internet up --state FILE [--tag T]` / `down --state FILE` for shell scripts;
`from_state(FILE)` reads the same JSON back in Python. Addresses are 198.51.100.0/24 and 203.0.113.0/24
(documentation ranges; 192.0.2.0/24 is the real network of some test machines, so it is not used).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NAMES: dict[str, str] = {
    "plain.test": "198.51.100.10",
    "echo.test": "198.51.100.20",
    "a.allowed.test": "198.51.100.11",
    "b.allowed.test": "198.51.100.12",
    "other.test": "198.51.100.13",
    "denied.test": "198.51.100.14",
    "socks.test": "198.51.100.80",
    "bulk.test": "203.0.113.50",
}
SITE_ADDRESSES = [f"198.51.100.{i}" for i in range(10, 31)] + ["198.51.100.53", "198.51.100.80", "203.0.113.50"]
OUR_IF, OUR_IP, PEER_IP = "ksfi0", "203.0.113.1", "203.0.113.2"
DNS_IP = "198.51.100.53"
SOCKS_IP, SOCKS_PORT, SOCKS_AUTH_PORT, SOCKS_USER, SOCKS_PASSWORD = "198.51.100.80", 1080, 1081, "u", "p"
LOG_PORT = 8080
BULK_IP, BULK_PORT = "203.0.113.50", 9000
ROLES = ("sites", "bulk")
READY_TIMEOUT = 60.0


class NotIsolated(RuntimeError):
    """Raised instead of changing routes in the host's root network namespace."""


def _netns_id(pid: str) -> tuple[int, int]:
    st = os.stat(f"/proc/{pid}/ns/net")
    return st.st_dev, st.st_ino


def in_root_netns() -> bool:
    """Whether this process is in the host's root network namespace (True when that cannot be told: fail closed).

    Compared with pid 1's; where pid 1's is unreadable (a confined init), with kthreadd's (pid 2), a kernel thread
    and so always in the root namespace."""
    own = _netns_id("self")
    try:
        return _netns_id("1") == own
    except OSError:
        pass
    try:
        if Path("/proc/2/comm").read_text().strip() == "kthreadd":
            return _netns_id("2") == own
    except OSError:
        pass
    return True


def _run(*args: str, stdin: str | None = None) -> str:
    proc = subprocess.run(list(args), input=stdin, capture_output=True, text=True)
    if proc.returncode != 0:
        raise OSError(f"{' '.join(args)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _site_names(names: dict[str, str]) -> dict[str, str]:
    """Address → the name `GET /` answers with: the first name the table gives it, else the address itself."""
    out = {a: a for a in SITE_ADDRESSES}
    for name, address in names.items():
        if out.get(address) == address:
            out[address] = name
    return out


class FakeInternet:
    def __init__(self, tag: str | None = None, names: dict[str, str] | None = None) -> None:
        self.tag = tag or str(os.getpid())
        self.names = dict(NAMES if names is None else names)
        for name, address in self.names.items():
            if address not in SITE_ADDRESSES:
                raise ValueError(f"{name} → {address}: not one of the fake internet's addresses")
        self.netns = f"ksfi-{self.tag}"
        self.state: dict[str, Any] = {}

    # What tests and benchmarks read (also in the state JSON).
    @property
    def ca_file(self) -> str:
        return str(self.state["ca_file"])

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"

    def nsenter(self, *args: str) -> list[str]:
        """A command line running `args` inside the fake internet's namespace."""
        return ["nsenter", f"--net={self.netns_path}", *args]

    def up(self, state_file: str | Path | None = None) -> dict[str, Any]:
        """Create the namespace, link and servers; return (and write to `state_file`) the state. Raises
        NotIsolated in the host's root network namespace, before changing anything."""
        if in_root_netns():
            raise NotIsolated("refusing to add a fake internet (and a default route) in the host's root network "
                              "namespace: run inside an isolated one (scripts/isolated.sh)")
        directory = Path(tempfile.mkdtemp(prefix=f"ksfi-{self.tag}-"))
        state_path = Path(state_file) if state_file else directory / "state.json"
        self.state = {
            "version": 1, "tag": self.tag, "netns": self.netns, "netns_path": self.netns_path, "dir": str(directory),
            "state_file": str(state_path), "interface": OUR_IF, "address": OUR_IP, "gateway": PEER_IP,
            "addresses": SITE_ADDRESSES, "names": self.names, "sites": _site_names(self.names),
            "dns": DNS_IP, "dns_port": 53,
            "socks": {"host": SOCKS_IP, "port": SOCKS_PORT, "url": f"socks5://{SOCKS_IP}:{SOCKS_PORT}"},
            "socks_auth": {"host": SOCKS_IP, "port": SOCKS_AUTH_PORT, "user": SOCKS_USER, "password": SOCKS_PASSWORD,
                           "url": f"socks5://{SOCKS_USER}:{SOCKS_PASSWORD}@{SOCKS_IP}:{SOCKS_AUTH_PORT}"},
            "socks_log_url": f"http://{SOCKS_IP}:{LOG_PORT}/log", "dns_log_url": f"http://{SOCKS_IP}:{LOG_PORT}/dns-log",
            "bulk": {"host": BULK_IP, "port": BULK_PORT}, "ca_file": str(directory / "ca.pem"), "pids": [],
        }
        try:
            self._write_ca(directory)
            self._make_network()
            self._write_state(state_path)
            self._start_servers(directory, state_path)
            self._write_state(state_path)
        except BaseException:
            self.down()
            raise
        return self.state

    def _write_ca(self, directory: Path) -> None:
        from cryptography.hazmat.primitives import serialization

        from keepstate.egress.ca import CA

        ca = CA.create("KeepState test internet CA")
        (directory / "ca.pem").write_bytes(ca.cert_pem)
        key = directory / "ca.key"
        key.write_bytes(ca.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()))
        key.chmod(0o600)

    def _make_network(self) -> None:
        _run("ip", "netns", "add", self.netns)
        _run("ip", "link", "add", OUR_IF, "type", "veth", "peer", "name", "eth0", "netns", self.netns)
        _run("ip", "addr", "add", f"{OUR_IP}/30", "dev", OUR_IF)
        _run("ip", "link", "set", OUR_IF, "up")
        inside = ["link set lo up", f"addr add {PEER_IP}/30 dev eth0", "link set eth0 up",
                  *(f"addr add {a}/32 dev lo" for a in SITE_ADDRESSES),
                  "route add unreachable default"]  # nothing beyond its own addresses and our /30
        _run(*self.nsenter("ip", "-batch", "-"), stdin="\n".join(inside) + "\n")
        # Forwarding on (to nowhere: the only routes are its own addresses, our /30 and `unreachable`), so a packet
        # for any other address is answered at once with ICMP unreachable instead of silently dropped.
        _run(*self.nsenter("sysctl", "-qw", "net.ipv4.ip_forward=1"))
        _run("ip", "route", "add", "default", "via", PEER_IP, "dev", OUR_IF)  # add, never replace

    def _start_servers(self, directory: Path, state_path: Path) -> None:
        import keepstate

        env = dict(os.environ)
        root = str(Path(keepstate.__file__).resolve().parents[1])  # this code, not another checkout's
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        procs = []
        for role in ROLES:
            log = open(directory / f"{role}.log", "ab")
            procs.append(subprocess.Popen(
                self.nsenter(sys.executable, "-m", "keepstate.testing.internet", "serve", "--state", str(state_path),
                             "--role", role),
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True))
            log.close()
            self.state["pids"].append(procs[-1].pid)
        deadline = time.monotonic() + READY_TIMEOUT
        for role, proc in zip(ROLES, procs, strict=True):
            while not (directory / f"{role}.ready").exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"fake internet {role} server exited with {proc.returncode}: "
                                       f"{(directory / f'{role}.log').read_text()[-2000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"fake internet {role} server not listening after {READY_TIMEOUT:g} s")
                time.sleep(0.02)

    def _write_state(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.state, indent=2))
        os.replace(tmp, path)

    def down(self) -> None:
        """Stop the servers and remove the namespace, link and files; safe to call twice or after a failed up()."""
        pids = [int(p) for p in self.state.get("pids", [])]
        for pid in pids:
            if _is_ours(pid):
                try:
                    os.killpg(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for pid in pids:
            while _is_ours(pid) and time.monotonic() < deadline:
                _reap(pid)
                time.sleep(0.02)
            if _is_ours(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _reap(pid)
        subprocess.run(["ip", "link", "del", OUR_IF], capture_output=True)  # takes our default route with it
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
        directory = self.state.get("dir")
        if directory:
            shutil.rmtree(directory, ignore_errors=True)
        self.state["pids"] = []


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _is_ours(pid: int) -> bool:
    """Whether `pid` is still a fake internet server (not a reused pid), and not a zombie."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return status.rsplit(")", 1)[1].split()[0] != "Z" and b"keepstate.testing.internet" in cmdline


def from_state(path: str | Path) -> FakeInternet:
    """The fake internet described by a state file that `up` wrote (to read its addresses, or to bring it down)."""
    state = json.loads(Path(path).read_text())
    fi = FakeInternet(state["tag"], state["names"])
    fi.state = state
    return fi


def _serve(state_path: str, role: str) -> None:
    """A server process's body (inside the namespace): listen on everything of `role`, say so, then serve."""
    state = json.loads(Path(state_path).read_text())
    directory = Path(state["dir"])
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    if role == "bulk":
        from keepstate.testing.internet_bulk import bulk_server

        server = bulk_server(BULK_IP, BULK_PORT)
        (directory / "bulk.ready").touch()
        server.serve_forever()
        return
    import asyncio

    asyncio.run(_serve_sites(state, directory))


async def _serve_sites(state: dict[str, Any], directory: Path) -> None:
    import asyncio

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from keepstate.egress.ca import CA
    from keepstate.testing.internet_dns import serve_dns
    from keepstate.testing.internet_http import Site, serve_site, tls_context
    from keepstate.testing.internet_socks import serve_socks

    key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    ca = CA(x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes()), key)
    names: dict[str, str] = state["names"]
    socks_log: list[dict[str, Any]] = []
    dns_log: list[dict[str, Any]] = []
    servers: list[object] = []
    for address, name in state["sites"].items():
        site = Site(address, name)
        cert, leaf_key = ca.issue(*([name, address] if name != address else [address]))
        servers.append(await serve_site(site, 80))
        servers.append(await serve_site(site, 443, tls_context(cert, leaf_key, str(directory))))
    logs = Site(SOCKS_IP, state["sites"][SOCKS_IP], {"/log": lambda: socks_log, "/dns-log": lambda: dns_log})
    servers.append(await serve_site(logs, LOG_PORT))
    servers.append(await serve_dns(DNS_IP, names, dns_log))
    servers.append(await serve_socks(SOCKS_IP, SOCKS_PORT, None, names, socks_log))
    servers.append(await serve_socks(SOCKS_IP, SOCKS_AUTH_PORT, (SOCKS_USER, SOCKS_PASSWORD), names, socks_log))
    (directory / "sites.ready").touch()
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m keepstate.testing.internet", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="create the fake internet and write its state JSON")
    up.add_argument("--state", required=True, help="where to write the state JSON")
    up.add_argument("--tag", help="names the namespace ksfi-<tag> (default: this process's pid)")
    down = sub.add_parser("down", help="remove the fake internet a state JSON describes")
    down.add_argument("--state", required=True)
    serve = sub.add_parser("serve", help="(internal) run one role's servers inside the namespace")
    serve.add_argument("--state", required=True)
    serve.add_argument("--role", choices=ROLES, required=True)
    args = parser.parse_args(argv)
    if args.command == "up":
        try:
            FakeInternet(args.tag).up(args.state)
        except NotIsolated as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "down":
        if not Path(args.state).exists():
            return 0
        from_state(args.state).down()
        Path(args.state).unlink(missing_ok=True)
        return 0
    _serve(args.state, args.role)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["NAMES", "SITE_ADDRESSES", "FakeInternet", "NotIsolated", "from_state", "in_root_netns"]
