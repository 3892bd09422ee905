"""A client of the OCI distribution API: auth discovery, manifests, blobs streamed to disk and verified.

Plain `http.client`, one connection per request: a pull is a handful of large, sequential transfers, and the
standard library keeps the agent-free server side free of another HTTP stack. The wire is written down in
docs/design/oci-images.md ("The wire").
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import re
import secrets
import ssl
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import DigestMismatch, ImageNotFound, RegistryAuthFailed, RegistryUnavailable, UnsupportedImage
from .ref import Reference

INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
CONFIG_TYPES = ("application/vnd.oci.image.config.v1+json", "application/vnd.docker.container.image.v1+json")
LAYER_TYPES = ("application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.v1.tar+gzip",
               "application/vnd.oci.image.layer.v1.tar+zstd", "application/vnd.docker.image.rootfs.diff.tar.gzip",
               "application/vnd.docker.image.rootfs.diff.tar")
CHUNK = 1 << 20
MAX_MANIFEST = 4 << 20  # the distribution spec's limit is 4 MiB
MAX_REDIRECTS = 5


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str

    def basic(self) -> str:
        return "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()


@dataclass(frozen=True)
class Manifest:
    media_type: str
    body: bytes
    digest: str

    def json(self) -> dict[str, object]:
        try:
            out = json.loads(self.body)
        except ValueError as e:
            raise UnsupportedImage(f"manifest {self.digest} is not JSON: {e}") from e
        if not isinstance(out, dict):
            raise UnsupportedImage(f"manifest {self.digest} is not a JSON object")
        return out


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    return scheme.lower(), {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', rest)}


class Registry:
    """One registry, one repository, one set of credentials: what a pull needs."""

    def __init__(self, ref: Reference, credentials: Credentials | None = None, timeout: float = 60.0) -> None:
        self.ref = ref
        self.credentials = credentials
        self.timeout = timeout
        self._auth: str | None = None
        self._scheme = ""  # "", "basic" or "bearer": what GET /v2/ asked for
        self._bearer: dict[str, str] = {}
        self.requests = 0  # how many requests this client sent (tests read it)

    # -- HTTP ------------------------------------------------------------------------------------------------
    @contextmanager
    def _open(self, method: str, url: str, headers: dict[str, str],
              auth: str | None) -> Iterator[http.client.HTTPResponse]:
        """One request, following redirects; Authorization goes only to the registry's own host."""
        home = urllib.parse.urlsplit(self.ref.base_url).netloc
        for _ in range(MAX_REDIRECTS + 1):
            u = urllib.parse.urlsplit(url)
            conn: http.client.HTTPConnection
            if u.scheme == "https":
                conn = http.client.HTTPSConnection(u.netloc, timeout=self.timeout,
                                                   context=ssl.create_default_context())
            elif u.scheme == "http":
                conn = http.client.HTTPConnection(u.netloc, timeout=self.timeout)
            else:
                raise RegistryUnavailable(f"registry {self.ref.host} redirected to an unsupported URL {url}")
            h = dict(headers)
            if auth and u.netloc == home:
                h["Authorization"] = auth
            path = u.path + (f"?{u.query}" if u.query else "")
            try:
                self.requests += 1
                conn.request(method, path or "/", headers=h)
                resp = conn.getresponse()
            except OSError as e:
                conn.close()
                raise RegistryUnavailable(f"registry {self.ref.host} is unreachable: {e}") from e
            if resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location"):
                url = urllib.parse.urljoin(url, resp.getheader("Location", ""))
                resp.read()
                conn.close()
                continue
            try:
                yield resp
            except (ConnectionError, TimeoutError, http.client.HTTPException, ssl.SSLError) as e:
                # A local disk error is not the registry's: only the connection's failures are named so.
                raise RegistryUnavailable(f"registry {self.ref.host}: transfer failed: {e}") from e
            finally:
                conn.close()
            return
        raise RegistryUnavailable(f"registry {self.ref.host}: more than {MAX_REDIRECTS} redirects for {url}")

    def _get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        with self._open("GET", self.ref.base_url + path, headers or {}, self._auth) as r:
            body = r.read(MAX_MANIFEST + 1)
            return r.status, {k.lower(): v for k, v in r.getheaders()}, body

    # -- auth ------------------------------------------------------------------------------------------------
    def authenticate(self) -> None:
        """`GET /v2/`, then whatever its challenge asks for: nothing, Basic, or a Bearer token."""
        status, headers, _ = self._get("/v2/")
        if status == 200:
            return
        if status != 401:
            self._fail(status, "/v2/")
        scheme, params = _challenge(headers.get("www-authenticate", ""))
        if scheme == "basic":
            if self.credentials is None:
                raise RegistryAuthFailed(f"registry {self.ref.host} needs credentials for {self.ref.repository}")
            self._scheme, self._auth = "basic", self.credentials.basic()
            status, _, _ = self._get("/v2/")
            if status == 401:
                raise RegistryAuthFailed(f"registry {self.ref.host} refused the credentials of user "
                                         f"`{self.credentials.username}`")
            if status != 200:
                self._fail(status, "/v2/")
        elif scheme == "bearer" and params.get("realm"):
            self._scheme, self._bearer = "bearer", params
            self._token()
        else:
            raise UnsupportedImage(f"registry {self.ref.host} asks for an unsupported authentication "
                                   f"`{headers.get('www-authenticate', '')}`")

    def _token(self) -> None:
        q = {"scope": f"repository:{self.ref.repository}:pull"}
        if self._bearer.get("service"):
            q["service"] = self._bearer["service"]
        realm = self._bearer["realm"]
        url = realm + ("&" if "?" in realm else "?") + urllib.parse.urlencode(q)
        basic = self.credentials.basic() if self.credentials else None
        # The token realm is often another host: send the Basic credentials there, and only there.
        h = {"Authorization": basic} if basic else {}
        with self._open("GET", url, h, None) as r:
            body = r.read(MAX_MANIFEST)
            if r.status == 401 or r.status == 403:
                who = f"of user `{self.credentials.username}`" if self.credentials else "(none given)"
                raise RegistryAuthFailed(f"registry {self.ref.host}'s token service refused the credentials {who}")
            if r.status != 200:
                raise RegistryUnavailable(f"registry {self.ref.host}'s token service answered {r.status}")
        try:
            token = json.loads(body).get("token") or json.loads(body).get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not token:
            raise RegistryUnavailable(f"registry {self.ref.host}'s token service sent no token")
        self._auth = f"Bearer {token}"

    def _fail(self, status: int, what: str, body: bytes = b"") -> None:
        if status in (401, 403):
            if self.credentials is None:
                raise RegistryAuthFailed(f"registry {self.ref.host} needs credentials for {self.ref.repository}")
            raise RegistryAuthFailed(f"registry {self.ref.host} refused the credentials of user "
                                     f"`{self.credentials.username}` for {self.ref.repository}")
        if status == 404:
            raise ImageNotFound(f"image {self.ref} not found")
        if status >= 500:
            raise RegistryUnavailable(f"registry {self.ref.host} answered {status} for {what}")
        raise RegistryUnavailable(f"registry {self.ref.host} answered {status} for {what}: "
                                  f"{body[:300].decode(errors='replace')}")

    # -- manifests and blobs ---------------------------------------------------------------------------------
    def manifest(self, ref: str) -> Manifest:
        """The manifest or index `ref` (a tag or a digest) names, its digest verified."""
        accept = ", ".join((*INDEX_TYPES, *MANIFEST_TYPES))
        path = f"/v2/{self.ref.repository}/manifests/{ref}"
        status, headers, body = self._get(path, {"Accept": accept})
        if status == 401 and self._scheme == "bearer":
            self._token()  # expired
            status, headers, body = self._get(path, {"Accept": accept})
        if status != 200:
            self._fail(status, f"manifest {ref}", body)
        if len(body) > MAX_MANIFEST:
            raise UnsupportedImage(f"manifest {ref} of image {self.ref} is over {MAX_MANIFEST >> 20} MiB")
        got = sha256_digest(body)
        want = ref if ref.startswith("sha256:") else headers.get("docker-content-digest")
        if want and want.startswith("sha256:") and want != got:
            raise DigestMismatch(f"digest mismatch for manifest {want} of image {self.ref} (got {got})")
        media = headers.get("content-type", "").split(";")[0].strip()
        try:
            declared = json.loads(body).get("mediaType")
        except (ValueError, AttributeError):
            declared = None
        media = declared or media
        if media not in INDEX_TYPES + MANIFEST_TYPES:
            raise UnsupportedImage(f"unsupported media type {media or '(none)'} for image {self.ref}")
        return Manifest(media_type=media, body=body, digest=got)

    def blob_to(self, digest: str, size: int | None, dest: Path) -> None:
        """Stream a blob into `dest`, verifying its sha256 and size; nothing is left at `dest` if it fails."""
        path = f"/v2/{self.ref.repository}/blobs/{digest}"
        tmp = dest.with_name(f".tmp-{dest.name}-{secrets.token_hex(6)}")  # pulls in parallel threads each own one
        h = hashlib.sha256()
        n = 0
        for attempt in (0, 1):
            with self._open("GET", self.ref.base_url + path, {}, self._auth) as r:
                if r.status == 401 and self._scheme == "bearer" and attempt == 0:
                    r.read()
                    self._token()
                    continue
                if r.status != 200:
                    self._fail(r.status, f"blob {digest}", r.read(4096))
                try:
                    with open(tmp, "wb") as f:
                        while chunk := r.read(CHUNK):
                            h.update(chunk)
                            n += len(chunk)
                            f.write(chunk)
                except BaseException:
                    tmp.unlink(missing_ok=True)
                    raise
            break
        got = "sha256:" + h.hexdigest()
        if got != digest or (size is not None and n != size):
            tmp.unlink(missing_ok=True)
            raise DigestMismatch(f"digest mismatch for blob {digest} of image {self.ref} "
                                 f"(got {got}, {n} bytes, expected {size})")
        os.replace(tmp, dest)
