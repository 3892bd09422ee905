"""Image references (`HOST[:PORT]/REPO[:TAG][@sha256:HEX]`), parsed before any network traffic.

A reference without a registry host is refused unless the operator names a mirror: no public registry is
reachable from here, and silently trying one would hang a build (docs/design/oci-images.md, "References").
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass

from keepstate.errors import BadRequest

MIRROR_ENV = "KEEPSTATE_REGISTRY_MIRROR"
INSECURE_ENV = "KEEPSTATE_INSECURE_REGISTRIES"

_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = re.compile(rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{{1,5}})?")


@dataclass(frozen=True)
class Reference:
    host: str  # registry host[:port], as written (or the mirror's)
    repository: str
    tag: str | None
    digest: str | None

    @property
    def ref(self) -> str:
        """What `GET /v2/<repo>/manifests/<ref>` names: the digest when there is one."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        out = f"{self.host}/{self.repository}"
        if self.tag:
            out += f":{self.tag}"
        if self.digest:
            out += f"@{self.digest}"
        return out

    @property
    def scheme(self) -> str:
        return "http" if insecure(self.host) else "https"

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.host}"


def valid_host(host: str) -> bool:
    """`HOST[:PORT]` as a reference may name it (an operator option is checked with the same rule)."""
    return bool(_HOST.fullmatch(host))


def _hostname(host: str) -> str:
    if host.startswith("["):
        return host[1:host.index("]")]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def insecure(host: str) -> bool:
    """Loopback registries and the operator's list speak plain HTTP; every other one HTTPS."""
    name = _hostname(host)
    listed = {h.strip() for h in os.environ.get(INSECURE_ENV, "").split(",") if h.strip()}
    if host in listed or name in listed or name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _looks_like_host(first: str) -> bool:
    return "." in first or ":" in first or first == "localhost" or first.startswith("[")


def parse(text: str, mirror: str | None = None) -> Reference:
    """A reference, or BadRequest saying which part is wrong. `mirror` defaults to $KEEPSTATE_REGISTRY_MIRROR."""
    if mirror is None:
        mirror = os.environ.get(MIRROR_ENV) or None
    s = text.strip()
    if not s:
        raise BadRequest("image reference is empty")
    digest = None
    if "@" in s:
        s, digest = s.split("@", 1)
        if not _DIGEST.fullmatch(digest):
            raise BadRequest(f"image `{text}`: digest must be sha256: and 64 lowercase hex digits")
    first, sep, rest = s.partition("/")
    host: str | None = None
    if sep and _looks_like_host(first):
        host, s = first, rest
        if not _HOST.fullmatch(host):
            raise BadRequest(f"image `{text}`: `{host}` is not a registry host[:port]")
    tag = None
    last = s.rsplit("/", 1)[-1]
    if ":" in last:
        s, tag = s.rsplit(":", 1)
        if not _TAG.fullmatch(tag):
            raise BadRequest(f"image `{text}`: tag `{tag}` must match [A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}}")
    if not s:
        raise BadRequest(f"image `{text}` names no repository")
    for comp in s.split("/"):
        if not _COMPONENT.fullmatch(comp):
            raise BadRequest(f"image `{text}`: repository component `{comp}` must be lowercase letters and digits, "
                             "separated by `.`, `_`, `__` or `-`")
    if host in ("docker.io", "index.docker.io", "registry-1.docker.io") and mirror:
        host = None  # Docker Hub goes through the operator's mirror, as in Docker's own registry-mirrors
    if host is None:
        if not mirror:
            raise BadRequest(f"image `{text}` names no registry: write HOST[:PORT]/{text} (no public registry is "
                             f"reachable from this server), or set a registry mirror (keepstate serve "
                             f"--registry-mirror, ${MIRROR_ENV})")
        host = mirror
        if "/" not in s:
            s = f"library/{s}"
    elif host in ("docker.io", "index.docker.io"):
        host = "registry-1.docker.io"
        if "/" not in s:
            s = f"library/{s}"
    if tag is None and digest is None:
        tag = "latest"
    return Reference(host=host, repository=s, tag=tag, digest=digest)
