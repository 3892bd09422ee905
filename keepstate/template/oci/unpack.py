"""Apply image layers, in order, to a root directory: whiteouts, owners, modes, links, nothing outside the root.

We unpack as root on the host, so a hostile layer (`../etc/passwd`, a symlink `etc -> /` then `etc/shadow`, a
hardlink to `/etc/shadow`) must never reach a host path: every parent is resolved inside the root as if the
root were `/` (like Go's securejoin), the last component is never followed, and `..` in a name refuses the
image (docs/design/oci-images.md, "Unpacking").
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import posixpath
import shutil
import stat
import tarfile
import zlib
from pathlib import Path
from typing import IO, cast

import zstandard

from .errors import DigestMismatch, UnsafeLayer

CHUNK = 1 << 20
MAX_SYMLINKS = 255
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


def clean_name(name: str, layer: str) -> str:
    """A member name relative to the root; `..` anywhere refuses the layer."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeLayer(f"layer {layer}: path `{name}` escapes the root")
    return "/".join(parts)


def secure_join(root: Path, rel: str) -> Path:
    """`root/rel` with each symlink on the way resolved as if `root` were `/`; the result is inside `root`.

    Components that do not exist yet are taken as they are (they will be made as directories).
    """
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    done: list[str] = []
    links = 0
    while parts:
        p = parts.pop(0)
        if p == "..":
            if done:
                done.pop()
            continue
        cand = os.path.join(root, *done, p)
        try:
            st = os.lstat(cand)
        except FileNotFoundError:
            done.append(p)
            continue
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_SYMLINKS:
                raise UnsafeLayer(f"too many levels of symlinks resolving `{rel}` in the image")
            target = os.readlink(cand)
            if target.startswith("/"):
                done = []
            parts = [x for x in target.split("/") if x not in ("", ".")] + parts
            continue
        done.append(p)
    return Path(root, *done)


def remove(path: Path) -> bool:
    """Whatever is at `path` (never following a symlink), if anything; True when that was a directory."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
        return True
    os.unlink(path)
    return False


class _Hashing(io.RawIOBase):
    """Reads through, hashing: the sha256 of a layer's uncompressed stream is its diff ID."""

    def __init__(self, inner: IO[bytes]) -> None:
        self.inner = inner
        self.h = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self.inner.read(len(b))
        n = len(data)
        b[:n] = data
        self.h.update(data)
        return n


def open_uncompressed(path: Path) -> IO[bytes]:
    """The layer's tar stream, compression read from its first bytes (gzip, zstd or none)."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic[:2] == b"\x1f\x8b":
        return cast(IO[bytes], gzip.open(path, "rb"))
    if magic == b"\x28\xb5\x2f\xfd":
        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True,
                                                          closefd=True)
    return open(path, "rb")


class _Layer:
    def __init__(self, root: Path, name: str) -> None:
        self.root = root
        self.name = name
        self.created: set[str] = set()
        self.opaque: list[str] = []
        self.dir_times: list[tuple[Path, float]] = []
        self.as_root = os.geteuid() == 0
        self.prefix = len(str(root)) + 1
        # Parents already resolved and made in this layer: a layer names the same few thousand directories
        # tens of thousands of times. Only removing a directory (a file or a whiteout over it) can make an
        # entry stale, so that clears the whole map.
        self.parents: dict[str, Path] = {}

    def rel(self, p: Path) -> str:
        return str(p)[self.prefix:]  # secure_join builds every path as root/...

    def remove(self, p: Path) -> None:
        if remove(p):
            self.parents.clear()

    def parent(self, dname: str) -> Path:
        if (cached := self.parents.get(dname)) is not None:
            return cached
        parent = secure_join(self.root, dname)
        try:
            os.makedirs(parent, mode=0o755, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as e:
            raise UnsafeLayer(f"layer {self.name}: `{dname}` is not a directory in the image") from e
        self.parents[dname] = parent
        return parent

    def apply(self, tf: tarfile.TarFile) -> None:
        for m in tf:
            rel = clean_name(m.name, self.name)
            if not rel:
                continue
            dname, base = posixpath.split(rel)
            if base == OPAQUE:
                self.opaque.append(dname)
                continue
            if base.startswith(WHITEOUT):
                self.remove(secure_join(self.root, dname) / base[len(WHITEOUT):])
                continue
            dest = self.parent(dname) / base
            self.created.add(self.rel(dest))
            self.member(tf, m, dest)
        for d in self.opaque:
            self.hide_lower(secure_join(self.root, d))
        for path, mtime in reversed(self.dir_times):
            os.utime(path, (mtime, mtime), follow_symlinks=False)

    def member(self, tf: tarfile.TarFile, m: tarfile.TarInfo, dest: Path) -> None:
        if m.isdir():
            try:
                if not stat.S_ISDIR(os.lstat(dest).st_mode):
                    self.remove(dest)
                    os.mkdir(dest, 0o700)
            except FileNotFoundError:
                os.mkdir(dest, 0o700)
            self.dir_times.append((dest, m.mtime))
        elif m.islnk():
            # The link's own last component is not followed: a hardlink to a symlink links the symlink.
            tdir, tbase = posixpath.split(clean_name(m.linkname, self.name))
            target = secure_join(self.root, tdir) / tbase
            try:
                st = os.lstat(target)
            except FileNotFoundError as e:
                raise UnsafeLayer(f"layer {self.name}: hardlink `{m.name}` to missing `{m.linkname}`") from e
            if stat.S_ISDIR(st.st_mode):
                raise UnsafeLayer(f"layer {self.name}: hardlink `{m.name}` to a directory `{m.linkname}`")
            if target == dest:
                return
            self.remove(dest)
            os.link(target, dest, follow_symlinks=False)
            return  # a hardlink shares its target's owner, mode and times
        else:
            self.remove(dest)
            if m.isreg():
                src = tf.extractfile(m)
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as out:
                    if src is not None:
                        shutil.copyfileobj(src, out, CHUNK)
            elif m.issym():
                os.symlink(m.linkname, dest)
            elif m.ischr() or m.isblk():
                kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK
                if not self.as_root:
                    return  # only root makes device nodes; an unprivileged unpack (tests) skips them
                os.mknod(dest, kind | 0o600, os.makedev(m.devmajor, m.devminor))
            elif m.isfifo():
                os.mkfifo(dest, 0o600)
            else:
                return
        self.metadata(m, dest)

    def metadata(self, m: tarfile.TarInfo, dest: Path) -> None:
        link = m.issym()
        if self.as_root:
            os.lchown(dest, m.uid, m.gid)
        if not link:
            os.chmod(dest, stat.S_IMODE(m.mode))  # after chown, which clears setuid and setgid
        for key, value in m.pax_headers.items():
            if key.startswith("SCHILY.xattr.") and not link:
                try:
                    os.setxattr(dest, key[len("SCHILY.xattr."):], value.encode("utf-8", "surrogateescape"))
                except OSError:
                    pass  # a filesystem without that xattr namespace: the file is still right
        if not m.isdir():
            os.utime(dest, (m.mtime, m.mtime), follow_symlinks=False)

    def hide_lower(self, d: Path) -> None:
        """An opaque directory: delete what lower layers put under `d`, keep what this layer made."""
        keep = set(self.created)
        for c in self.created:
            while c not in ("", "."):
                c = posixpath.dirname(c)
                keep.add(c)
        for dirpath, dirnames, filenames in os.walk(d, topdown=False):
            for n in filenames + dirnames:
                p = Path(dirpath, n)
                if self.rel(p) not in keep:
                    remove(p)


def apply_layer(root: Path, blob: Path, name: str, diff_id: str | None = None) -> str:
    """Unpack one layer blob into `root`; returns its diff ID, checked against `diff_id` when given."""
    with open_uncompressed(blob) as raw:
        hashing = _Hashing(raw)
        buffered = io.BufferedReader(hashing, CHUNK)
        try:
            with tarfile.open(fileobj=buffered, mode="r|") as tf:
                _Layer(root, name).apply(tf)
            while buffered.read(CHUNK):
                pass
        except (tarfile.TarError, gzip.BadGzipFile, EOFError, zlib.error, zstandard.ZstdError) as e:
            raise UnsafeLayer(f"layer {name} is not a valid (compressed) tar: {e}") from e
        got = "sha256:" + hashing.h.hexdigest()
    if diff_id and got != diff_id:
        raise DigestMismatch(f"layer {name}: uncompressed digest {got} differs from the config's diff ID {diff_id}")
    return got
