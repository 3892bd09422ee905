"""What `/init`'s `network` sets up inside the sandbox: its resolver and the CAs it trusts (docs/design/network.md).

The egress proxy terminates TLS for hosts with header rules with a certificate from the server's egress CA, so
every TLS client in the sandbox must trust that CA: the system bundle, every `certifi` copy (Python's requests and
httpx use it, not the system's), and the variables Node, OpenSSL and requests read. Idempotent: the CAs go in
between markers, replaced on each /init (a restore or a fork gets /init again), never appended twice.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

BEGIN = "# --- keepstate egress CA (begin) ---\n"
END = "# --- keepstate egress CA (end) ---\n"
SYSTEM_BUNDLE = "etc/ssl/certs/ca-certificates.crt"
OWN_BUNDLE = "etc/keepstate/ca.pem"
CERTIFI = (
    "usr/lib/python3*/site-packages/certifi/cacert.pem",
    "usr/lib/python3/dist-packages/certifi/cacert.pem",
    "usr/local/lib/python3*/site-packages/certifi/cacert.pem",
    "usr/local/lib/python3*/dist-packages/certifi/cacert.pem",
    "usr/lib/python3*/site-packages/pip/_vendor/certifi/cacert.pem",
    "usr/lib/python3/dist-packages/pip/_vendor/certifi/cacert.pem",
    "usr/local/lib/python3*/site-packages/pip/_vendor/certifi/cacert.pem",
    "root/.local/lib/python3*/site-packages/certifi/cacert.pem",
    "home/*/.local/lib/python3*/site-packages/certifi/cacert.pem",
    "opt/*/lib/python3*/site-packages/certifi/cacert.pem",
    "home/*/*/lib/python3*/site-packages/certifi/cacert.pem",
)


def _with_block(text: str, block: str) -> str:
    """`text` with our marked block replaced by `block` (or added at the end)."""
    start = text.find(BEGIN)
    if start >= 0:
        end = text.find(END, start)
        text = text[:start] + (text[end + len(END):] if end >= 0 else "")
    if text and not text.endswith("\n"):
        text += "\n"
    return text + BEGIN + block.strip("\n") + "\n" + END


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.keepstate")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def install_bundle(bundle: str, root: Path = Path("/")) -> dict[str, str]:
    """Trust `bundle` (PEM) everywhere; returns the environment variables that point clients at it."""
    own = root / OWN_BUNDLE
    _write(own, bundle.strip("\n") + "\n")
    system = root / SYSTEM_BUNDLE
    targets: list[Path] = [system]
    for pattern in CERTIFI:
        targets += [Path(p) for p in glob.glob(str(root / pattern))]
    done: set[str] = set()
    for path in targets:
        real = os.path.realpath(path)  # Debian's certifi is a link to the system bundle: one block, not two
        if real in done:
            continue
        done.add(real)
        try:
            old = Path(real).read_text() if os.path.exists(real) else ""
            _write(Path(real), _with_block(old, bundle))
        except OSError:
            continue  # a read-only copy: its users fall back on the variables below
    return {"NODE_EXTRA_CA_CERTS": f"/{OWN_BUNDLE}", "SSL_CERT_FILE": f"/{SYSTEM_BUNDLE}",
            "REQUESTS_CA_BUNDLE": f"/{SYSTEM_BUNDLE}"}


def apply(network: dict[str, str], root: Path = Path("/")) -> dict[str, str]:
    """Set up /init's `network` ({"resolvConf", "caBundle"}); the variables to add to the default environment."""
    env: dict[str, str] = {}
    resolv = network.get("resolvConf")
    if resolv:
        path = root / "etc/resolv.conf"
        if path.is_symlink():  # systemd-resolved's link: ours replaces it
            path.unlink()
        _write(path, resolv if resolv.endswith("\n") else resolv + "\n")
    bundle = network.get("caBundle")
    if bundle and "BEGIN CERTIFICATE" in bundle:
        env.update(install_bundle(bundle, root))
    return env
