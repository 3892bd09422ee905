"""A real OCI registry on loopback for tests: Debian's `docker-registry` (distribution 2.8), pushed to by skopeo.

No public registry is reachable from here, and a test must not try one: the registry listens on 127.0.0.1 at a
free port, keeps its storage in a directory the test owns, and, when asked, wants htpasswd (bcrypt) logins.
Its access log is kept, so a test can count what a client fetched.
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from .registry_token import ISSUER, SERVICE, TokenServer

READY_SECONDS = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Registry:
    """`with Registry(auth=("user", "pw")) as reg: reg.push_layout(dir, "repo:tag")`."""

    def __init__(self, auth: tuple[str, str] | None = None, workdir: Path | None = None,
                 token: bool = False) -> None:
        """`auth`: one login; htpasswd (Basic) unless `token`, which puts a Bearer token service in front."""
        if shutil.which("docker-registry") is None or shutil.which("skopeo") is None:
            raise RuntimeError("the test registry needs Debian's docker-registry and skopeo (scripts/setup-host.sh)")
        self.auth = auth
        self._own = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="keepstate-registry-"))
        self.storage = self.dir / "storage"
        self.log_path = self.dir / "registry.log"
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.tokens: TokenServer | None = None
        if token:
            if auth is None:
                raise ValueError("a token service needs a login (auth)")
            self.tokens = TokenServer({auth[0]: auth[1]})

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _config(self) -> Path:
        auth = ""
        if self.tokens is not None:
            cert = self.tokens.write_cert(self.dir / "token-cert.pem")
            auth = (f"auth:\n  token:\n    realm: {self.tokens.realm}\n    service: {SERVICE}\n"
                    f"    issuer: {ISSUER}\n    rootcertbundle: {cert}\n")
        elif self.auth:
            line = subprocess.run(["htpasswd", "-Bbn", *self.auth], check=True, capture_output=True,
                                  text=True).stdout.strip()
            (self.dir / "htpasswd").write_text(line + "\n")
            auth = f"auth:\n  htpasswd:\n    realm: keepstate-test\n    path: {self.dir / 'htpasswd'}\n"
        cfg = self.dir / "config.yml"
        cfg.write_text(
            "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: false\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n{auth}")
        return cfg

    def start(self) -> Registry:
        self.storage.mkdir(parents=True, exist_ok=True)
        if self.tokens is not None:
            self.tokens.start()
        for _ in range(5):  # another process may take the free port between our probe and the registry's bind
            self.port = _free_port()
            log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(["docker-registry", "serve", str(self._config())], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            log.close()
            if self._wait_ready():
                return self
            self.stop()
        raise RuntimeError(f"docker-registry did not start; its log: {self.log_path.read_text()[-2000:]}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + READY_SECONDS
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/v2/")
                status = c.getresponse().status
                c.close()
                if status in (200, 401):
                    return True
            except OSError:
                pass
            time.sleep(0.05)  # polling for a condition with a deadline, not a guessed wait
        return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self.tokens is not None:
            self.tokens.stop()
        if self._own:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Registry:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- pushing, inspecting ----------------------------------------------------------------------------------
    def push_layout(self, layout: Path, name: str, tag: str = "latest", fmt: str = "oci") -> str:
        """Push the OCI layout's image `tag` as `name` (`repo:tag`) with skopeo; returns the manifest digest.

        `fmt` is skopeo's `--format`: `oci` keeps OCI media types, `v2s2` converts to Docker's.
        """
        policy = self.dir / "policy.json"
        policy.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
        digest_file = self.dir / "pushed.digest"
        cmd = ["skopeo", "--policy", str(policy), "copy", "--quiet", "--dest-tls-verify=false", "--format", fmt,
               "--digestfile", str(digest_file), "--all"]  # an index is pushed whole, every platform
        if self.auth:
            cmd += ["--dest-creds", f"{self.auth[0]}:{self.auth[1]}"]
        cmd += [f"oci:{layout}:{tag}", f"docker://{self.host}/{name}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"skopeo copy failed: {proc.stderr.strip()[-2000:]}")
        return digest_file.read_text().strip()

    def blob_file(self, digest: str) -> Path:
        """Where the registry stores a blob (distribution's filesystem driver layout)."""
        hexd = digest.split(":", 1)[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def access_log(self) -> list[tuple[str, str, int]]:
        """(method, path, status) of every request the registry has logged so far."""
        out = []
        for m in re.finditer(r'"(GET|HEAD|PUT|POST|PATCH|DELETE) (\S+) HTTP/[\d.]+" (\d{3})',
                             self.log_path.read_text(errors="replace")):
            out.append((m.group(1), m.group(2), int(m.group(3))))
        return out

    def blob_gets(self) -> list[str]:
        """Paths of the successful blob downloads logged so far."""
        return [p for m, p, s in self.access_log() if m == "GET" and "/blobs/" in p and s == 200]

    def wait_logged(self, path: str, timeout: float = 10.0) -> None:
        """Send a request for `path` and wait until the registry has logged it: everything before is logged."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        c.request("GET", path)
        c.getresponse().read()
        c.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p == path for _, p, _ in self.access_log()):
                return
            time.sleep(0.02)
        raise RuntimeError(f"the registry never logged {path}")
