"""OCI image layouts written from Python (real tar layers, a config, a manifest, `index.json`), for tests.

The images the template tests pull: `two_layer_image` (a whiteout, an opaque directory, links, owners and
a setuid mode) and `busybox_image` (Debian's static busybox alone: no Python, no glibc). Push one with
`keepstate.testing.registry.Registry.push_layout`.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, cast

import zstandard

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = {None: "application/vnd.oci.image.layer.v1.tar", "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
         "zstd": "application/vnd.oci.image.layer.v1.tar+zstd"}
FIXED_MTIME = 1_700_000_000


@dataclass
class Entry:
    """One tar member: kind is file, dir, symlink, hardlink or fifo; `target` for links."""

    path: str
    kind: str = "file"
    data: bytes = b""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    target: str = ""


def tar_layer(entries: list[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for e in entries:
            ti = tarfile.TarInfo(e.path)
            ti.mode, ti.uid, ti.gid, ti.mtime = e.mode, e.uid, e.gid, FIXED_MTIME
            if e.kind == "dir":
                ti.type = tarfile.DIRTYPE
            elif e.kind == "symlink":
                ti.type, ti.linkname = tarfile.SYMTYPE, e.target
            elif e.kind == "hardlink":
                ti.type, ti.linkname = tarfile.LNKTYPE, e.target
            elif e.kind == "fifo":
                ti.type = tarfile.FIFOTYPE
            else:
                ti.size = len(e.data)
            tf.addfile(ti, io.BytesIO(e.data) if e.kind == "file" else None)
    return buf.getvalue()


@dataclass
class Layout:
    dir: Path
    manifest_digest: str = ""
    blobs: dict[str, bytes] = field(default_factory=dict)

    def blob(self, data: bytes) -> dict[str, object]:
        d = "sha256:" + hashlib.sha256(data).hexdigest()
        (self.dir / "blobs/sha256").mkdir(parents=True, exist_ok=True)
        (self.dir / "blobs/sha256" / d[7:]).write_bytes(data)
        self.blobs[d] = data
        return {"digest": d, "size": len(data)}


def write_layout(dest: Path, layers: list[bytes], config: dict[str, object], tag: str = "latest",
                 compression: str | None = "gzip") -> Layout:
    """An OCI image layout at `dest` holding one image, tagged `tag`."""
    dest.mkdir(parents=True, exist_ok=True)
    lay = Layout(dest)
    (dest / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    descs = []
    for raw in layers:
        data = raw
        if compression == "gzip":
            data = gzip.compress(raw, mtime=0)
        elif compression == "zstd":
            data = zstandard.ZstdCompressor().compress(raw)
        descs.append({"mediaType": LAYER[compression], **lay.blob(data)})
    cfg = {"architecture": "amd64", "os": "linux", "config": config,
           "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(r).hexdigest() for r in layers]}}
    cdesc = {"mediaType": CONFIG, **lay.blob(json.dumps(cfg).encode())}
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST, "config": cdesc, "layers": descs}
    mdesc = lay.blob(json.dumps(manifest).encode())
    lay.manifest_digest = str(mdesc["digest"])
    (dest / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": MANIFEST, **mdesc, "annotations": {"org.opencontainers.image.ref.name": tag}}]}))
    return lay


def two_layer_image(dest: Path, compression: str | None = "gzip") -> Layout:
    """Layer 1 lays down files, a symlink, a hardlink, a setuid file of uid 1000, a FIFO and a directory with
    contents; layer 2 deletes `etc/gone` (whiteout), makes `opt/old` opaque (its old contents vanish), adds
    `opt/old/new`, replaces a file by a directory and a directory by a file."""
    one = tar_layer([
        Entry("etc", "dir", mode=0o755), Entry("etc/a", data=b"a\n"), Entry("etc/gone", data=b"gone\n"),
        Entry("etc/link", "symlink", target="a"), Entry("etc/abs", "symlink", target="/etc/a"),
        Entry("etc/hard", "hardlink", target="etc/a"),
        Entry("opt", "dir", mode=0o755), Entry("opt/old", "dir", mode=0o750),
        Entry("opt/old/x", data=b"x\n"), Entry("opt/old/sub", "dir"), Entry("opt/old/sub/y", data=b"y\n"),
        Entry("usr/bin/tool", data=b"#!/bin/sh\n", mode=0o4755, uid=1000, gid=1000),
        Entry("run/fifo", "fifo", mode=0o600),
        Entry("was-file", data=b"f\n"), Entry("was-dir", "dir"), Entry("was-dir/inner", data=b"i\n"),
    ])
    two = tar_layer([
        Entry("etc/.wh.gone"), Entry("opt/old/new", data=b"new\n"), Entry("opt/old/.wh..wh..opq"),
        Entry("was-file", "dir", mode=0o700), Entry("was-dir", data=b"now a file\n"),
        Entry("home/user/hello.txt", data=b"hello\n", uid=1000, gid=1000),
    ])
    return write_layout(dest, [one, two], {"Env": ["PATH=/usr/bin:/bin", "GREETING=hi there"],
                                           "User": "1000:1000", "WorkingDir": "/home/user",
                                           "Cmd": ["/bin/sh"], "Entrypoint": ["/usr/bin/tool"]},
                        compression=compression)


def busybox_image(dest: Path) -> Layout:
    """Debian's static busybox with a link per applet, an /etc/passwd and /tmp: no Python, no glibc."""
    binary = Path("/bin/busybox").read_bytes()
    applets = subprocess.run(["/bin/busybox", "--list"], check=True, capture_output=True,
                             text=True).stdout.split()
    entries = [Entry("bin", "dir", mode=0o755), Entry("bin/busybox", data=binary, mode=0o755),
               *(Entry(f"bin/{a}", "symlink", target="busybox") for a in applets if a != "busybox"),
               Entry("etc", "dir", mode=0o755),
               Entry("etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n"),
               Entry("etc/group", data=b"root:x:0:\nuser:x:1000:\n"),
               Entry("tmp", "dir", mode=0o1777), Entry("root", "dir", mode=0o700),
               Entry("home/user", "dir", mode=0o755, uid=1000, gid=1000)]
    return write_layout(dest, [tar_layer(entries)], {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]})


INDEX = "application/vnd.oci.image.index.v1+json"


def as_index(lay: Layout, platforms: list[str], tag: str = "latest") -> Layout:
    """Turn a one-image layout into a multi-platform one: an image index whose entries (`os/arch`) all name the
    same layers, each with a config of its own architecture. The layout's tag then names the index."""
    base = json.loads(lay.blobs[lay.manifest_digest])
    base_cfg = json.loads(lay.blobs[base["config"]["digest"]])
    entries = []
    for plat in platforms:
        os_, arch = plat.split("/")
        cdesc = {"mediaType": CONFIG, **lay.blob(json.dumps({**base_cfg, "os": os_, "architecture": arch}).encode())}
        mdesc = lay.blob(json.dumps({**base, "config": cdesc}).encode())
        entries.append({"mediaType": MANIFEST, **mdesc, "platform": {"os": os_, "architecture": arch}})
    idesc = lay.blob(json.dumps({"schemaVersion": 2, "mediaType": INDEX, "manifests": entries}).encode())
    lay.manifest_digest = str(idesc["digest"])
    (lay.dir / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": INDEX, **idesc, "annotations": {"org.opencontainers.image.ref.name": tag}}]}))
    return lay


class _HashingWriter(io.RawIOBase):
    def __init__(self, inner: IO[bytes]) -> None:
        self.inner = inner
        self.h = hashlib.sha256()
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, b: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        self.h.update(b)
        self.n += len(b)
        self.inner.write(b)
        return len(b)


def rootfs_image(src: Path, dest: Path, config: dict[str, object], tag: str = "latest") -> Layout:
    """A one-layer (zstd) image of a directory tree, streamed to disk: how a test turns a built template's root
    (the base rootfs, hundreds of MiB) into an image to push. Owners are kept as numbers, hardlinks as links."""
    lay = Layout(dest)
    blobs = dest / "blobs/sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    (dest / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    tmp = blobs / ".layer"

    def numeric(ti: tarfile.TarInfo) -> tarfile.TarInfo:
        ti.uname = ti.gname = ""
        return ti

    with open(tmp, "wb") as out:
        compressed = _HashingWriter(out)
        with zstandard.ZstdCompressor().stream_writer(cast(IO[bytes], compressed), closefd=False) as z:
            plain = _HashingWriter(z)
            with tarfile.open(fileobj=plain, mode="w|", format=tarfile.PAX_FORMAT) as tf:
                for name in sorted(os.listdir(src)):
                    tf.add(src / name, arcname=name, recursive=True, filter=numeric)
    digest = "sha256:" + compressed.h.hexdigest()
    os.replace(tmp, blobs / digest[7:])
    ldesc = {"mediaType": LAYER["zstd"], "digest": digest, "size": compressed.n}
    cfg = {"architecture": "amd64", "os": "linux", "config": config,
           "rootfs": {"type": "layers", "diff_ids": ["sha256:" + plain.h.hexdigest()]}}
    cdesc = {"mediaType": CONFIG, **lay.blob(json.dumps(cfg).encode())}
    mdesc = lay.blob(json.dumps({"schemaVersion": 2, "mediaType": MANIFEST, "config": cdesc,
                                 "layers": [ldesc]}).encode())
    lay.manifest_digest = str(mdesc["digest"])
    (dest / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": MANIFEST, **mdesc, "annotations": {"org.opencontainers.image.ref.name": tag}}]}))
    return lay
