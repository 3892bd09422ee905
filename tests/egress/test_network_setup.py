"""/init's `network` inside the sandbox (agent/network_setup.py), against a root of the test's own."""

from __future__ import annotations

import os
from pathlib import Path

from keepstate.agent import network_setup
from keepstate.agent.settings import parse_init
from keepstate.egress.ca import CA


def test_resolver_and_ca_are_installed_once_however_often_init_comes(tmp_path: Path) -> None:
    root = tmp_path
    system = root / "etc/ssl/certs/ca-certificates.crt"
    system.parent.mkdir(parents=True)
    system.write_text("-----BEGIN CERTIFICATE-----\nSYSTEM\n-----END CERTIFICATE-----\n")
    certifi = root / "usr/local/lib/python3.11/site-packages/certifi/cacert.pem"
    certifi.parent.mkdir(parents=True)
    certifi.write_text("-----BEGIN CERTIFICATE-----\nCERTIFI\n-----END CERTIFICATE-----\n")
    linked = root / "usr/lib/python3/dist-packages/certifi/cacert.pem"  # Debian's: a link to the system bundle
    linked.parent.mkdir(parents=True)
    os.symlink(system, linked)
    (root / "etc/resolv.conf").write_text("nameserver 198.51.100.1\n")
    ca = CA.create("test egress").cert_pem.decode()
    net = {"resolvConf": "nameserver 10.88.255.254\n", "caBundle": ca}
    for _ in range(3):  # a restore and a fork get /init again
        env = network_setup.apply(net, root)
    assert (root / "etc/resolv.conf").read_text() == "nameserver 10.88.255.254\n"
    for path in (system, certifi):
        text = path.read_text()
        assert text.count(ca.strip()) == 1 and text.count(network_setup.BEGIN) == 1
        assert "SYSTEM" in text or "CERTIFI" in text  # what was trusted before stays trusted
    assert (root / "etc/keepstate/ca.pem").read_text().strip() == ca.strip()
    assert env == {"NODE_EXTRA_CA_CERTS": "/etc/keepstate/ca.pem",
                   "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt",
                   "REQUESTS_CA_BUNDLE": "/etc/ssl/certs/ca-certificates.crt"}
    other = CA.create("another").cert_pem.decode()  # a new server's CA replaces the old one
    network_setup.apply({"caBundle": other}, root)
    assert ca.strip() not in system.read_text() and other.strip() in system.read_text()


def test_init_parses_network() -> None:
    init = parse_init({"network": {"resolvConf": "nameserver 10.88.255.254\n", "caBundle": "x", "other": 1}})
    assert init.network == {"resolvConf": "nameserver 10.88.255.254\n", "caBundle": "x"}
    assert parse_init({}).network is None
