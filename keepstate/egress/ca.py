"""A certificate authority of this server's own, and the leaf certificates it issues on demand.

One CA per data directory (`<home>/tls/<name>-ca.pem`, key 0600): the egress proxy signs a certificate for each host
whose HTTPS it must terminate (a host with header rules), and the router signs its own for `<port>-<id>.<domain>`
when the operator gives none. Sandboxes trust the egress CA (installed at start); a developer trusts the router's
with the command `keepstate tls trust` prints. Keys are P-256: issuing one takes about a millisecond.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LEAF_DAYS = 30
CA_DAYS = 3650
CACHE = 512


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class CA:
    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.cert = cert
        self.key = key
        self.cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        self._leaves: OrderedDict[str, ssl.SSLContext] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def load_or_create(cls, directory: Path, name: str) -> CA:
        """The CA kept in `directory` as `<name>-ca.pem`/`<name>-ca.key`, made on first use."""
        cert_path, key_path = directory / f"{name}-ca.pem", directory / f"{name}-ca.key"
        if cert_path.exists() and key_path.exists():
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            assert isinstance(key, ec.EllipticCurvePrivateKey)
            return cls(cert, key)
        ca = cls.create(f"KeepState {name} CA")
        _write_private(key_path, ca.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
        _write_private(cert_path, ca.cert_pem)
        os.chmod(cert_path, 0o644)
        return ca

    @classmethod
    def create(cls, common_name: str) -> CA:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = dt.datetime.now(dt.UTC)
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=CA_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        return cls(cert, key)

    def issue(self, *names: str) -> tuple[bytes, bytes]:
        """A leaf certificate for `names` (DNS names or IP addresses), signed by this CA: (cert PEM, key PEM)."""
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = []
        for n in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                sans.append(x509.DNSName(n))
        now = dt.datetime.now(dt.UTC)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64])]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=LEAF_DAYS))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                               critical=False)
                .sign(self.key, hashes.SHA256()))
        return (cert.public_bytes(serialization.Encoding.PEM),
                key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))

    def server_context(self, host: str) -> ssl.SSLContext:
        """A server-side TLS context presenting a certificate for `host` (made once, then cached)."""
        host = host.lower()
        with self._lock:
            ctx = self._leaves.get(host)
            if ctx is not None:
                self._leaves.move_to_end(host)
                return ctx
        cert, key = self.issue(host)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.set_alpn_protocols(["http/1.1"])
        with tempfile.TemporaryDirectory() as d:  # load_cert_chain reads files only
            (Path(d) / "c.pem").write_bytes(cert + self.cert_pem)
            (Path(d) / "k.pem").write_bytes(key)
            ctx.load_cert_chain(Path(d) / "c.pem", Path(d) / "k.pem")
        with self._lock:
            self._leaves[host] = ctx
            while len(self._leaves) > CACHE:
                self._leaves.popitem(last=False)
        return ctx
