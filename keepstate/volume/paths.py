"""Paths inside a volume root, resolved by the kernel beneath it (docs/design/volumes.md, "Paths are resolved...").

The server is root and a sandbox may leave anything in a volume (a symlink to /etc, a FIFO). So no path is ever
joined and opened as a string: every call opens the volume root, resolves the parent directory with openat2(2)
and RESOLVE_BENEATH (a symlink or `..` that would leave the root fails in the kernel with EXDEV), and acts on the
last component relative to that descriptor without following it. Blocking; the API calls these in threads.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from keepstate.errors import BadRequest, Conflict, NotFound, PayloadTooLarge

SYS_OPENAT2 = 437  # the same number on every Linux architecture
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
MAX_PATH = 4096
MAX_NAME = 255
MAX_DEPTH = 16
DEFAULT_UID = DEFAULT_GID = 1000  # the templates' `user`: sandboxes can write what the content API made
_libc = ctypes.CDLL(None, use_errno=True)


def parts_of(path: str) -> list[str]:
    """A volume path's components: absolute or relative (both are from the volume root), `//` and `.` dropped;
    `..`, NUL, over-long paths and names are a BadRequest."""
    if not isinstance(path, str) or not path:
        raise BadRequest("query parameter `path` is required (a path inside the volume, e.g. /dir/file.txt)")
    if "\0" in path:
        raise BadRequest("`path` holds a NUL character")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_PATH:
        raise BadRequest(f"`path` is longer than {MAX_PATH} bytes")
    out = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            raise BadRequest(f"`path` {path!r} contains `..`: paths may not climb (no traversal)")
        if len(part.encode("utf-8", "surrogateescape")) > MAX_NAME:
            raise BadRequest(f"`path` has a name longer than {MAX_NAME} bytes")
        out.append(part)
    return out


def display(parts: list[str]) -> str:
    return "/" + "/".join(parts)


def openat2(dir_fd: int, rel: str, flags: int, mode: int = 0, shown: str = "") -> int:
    """openat2(dir_fd, rel, {flags, mode, RESOLVE_BENEATH|RESOLVE_NO_MAGICLINKS}); errors as our errors."""
    how = struct.pack("QQQ", flags | os.O_CLOEXEC, mode, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(SYS_OPENAT2, dir_fd, rel.encode("utf-8", "surrogateescape"), how, len(how))
    if fd >= 0:
        return int(fd)
    err = ctypes.get_errno()
    shown = shown or rel
    if err in (errno.EXDEV, errno.ELOOP):
        raise BadRequest(f"path {shown!r} leads out of the volume (through a symlink); refused")
    if err == errno.ENOENT:
        raise NotFound(f"path {shown!r} not found in the volume")
    if err == errno.ENOTDIR:
        raise BadRequest(f"path {shown!r}: a parent is not a directory")
    if err == errno.ENOSYS:
        raise OSError(err, "openat2(2) is not available: volumes need Linux 5.6 or later")
    raise OSError(err, f"{os.strerror(err)}: {shown}")


def _type(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "unknown"


def _time(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def entry(parts: list[str], st: os.stat_result, target: str | None = None) -> dict[str, Any]:
    """E2B's VolumeEntryStat of one entry."""
    out: dict[str, Any] = {
        "name": parts[-1] if parts else "/", "type": _type(st.st_mode), "path": display(parts),
        "size": st.st_size, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid,
        "atime": _time(st.st_atime), "mtime": _time(st.st_mtime), "ctime": _time(st.st_ctime),
    }
    if target is not None:
        out["target"] = target
    return out


@dataclass
class VolumeRoot:
    """One volume's tree: `root` is what sandboxes mount, `uploads` a directory on the same filesystem (outside
    `root`) where uploads are written before they are renamed into place; `quota` bytes are the most the tree may
    hold when the filesystem does not enforce it itself (the `dir` backend), else None."""

    root: Path
    uploads: Path
    quota: int | None = None

    @contextmanager
    def _root_fd(self) -> Iterator[int]:
        fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextmanager
    def dir_fd(self, parts: list[str]) -> Iterator[int]:
        """An O_PATH descriptor of the directory `parts` (the root for []), resolved beneath the root."""
        with self._root_fd() as root:
            if not parts:
                fd = os.dup(root)
            else:
                fd = openat2(root, "/".join(parts), os.O_PATH | os.O_DIRECTORY, shown=display(parts))
            try:
                yield fd
            finally:
                os.close(fd)

    # -- reading -----------------------------------------------------------------------------------------------
    def stat(self, path: str) -> dict[str, Any]:
        parts = parts_of(path)
        if not parts:
            return entry(parts, os.stat(self.root))
        with self.dir_fd(parts[:-1]) as parent:
            return self._entry(parent, parts)

    def _entry(self, parent: int, parts: list[str]) -> dict[str, Any]:
        try:
            st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
            target = os.readlink(parts[-1], dir_fd=parent) if stat.S_ISLNK(st.st_mode) else None
        except FileNotFoundError:
            raise NotFound(f"path {display(parts)!r} not found in the volume") from None
        return entry(parts, st, target)

    def listdir(self, path: str, depth: int = 1) -> list[dict[str, Any]]:
        """Entries below `path`, `depth` levels deep (symlinked directories are listed, not entered)."""
        if not 1 <= depth <= MAX_DEPTH:
            raise BadRequest(f"`depth` must be from 1 to {MAX_DEPTH}")
        parts = parts_of(path)
        if parts:
            with self.dir_fd(parts[:-1]) as parent:
                kind = self._entry(parent, parts)["type"]  # a 404 when missing
            if kind not in ("directory", "symlink"):  # a symlink is entered if it stays in the volume
                raise BadRequest(f"path {display(parts)!r} is not a directory")
        out: list[dict[str, Any]] = []
        self._walk(parts, depth, out)
        return sorted(out, key=lambda e: e["path"])

    def _walk(self, parts: list[str], depth: int, out: list[dict[str, Any]]) -> None:
        with self.dir_fd(parts) as fd:
            listing = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            try:
                names = sorted(os.listdir(listing))
            finally:
                os.close(listing)
            subdirs = []
            for name in names:
                try:
                    e = self._entry(fd, [*parts, name])
                except NotFound:
                    continue  # removed while we listed
                out.append(e)
                if e["type"] == "directory":
                    subdirs.append(name)
        if depth > 1:
            for name in subdirs:
                self._walk([*parts, name], depth - 1, out)

    def open_file(self, path: str) -> tuple[int, int]:
        """(fd, size) of a regular file, for reading; the caller closes it."""
        parts = parts_of(path)
        if not parts:
            raise BadRequest("path '/' is a directory, not a file")
        with self._root_fd() as root:
            fd = openat2(root, "/".join(parts), os.O_RDONLY | os.O_NONBLOCK, shown=display(parts))
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise BadRequest(f"path {display(parts)!r} is {kind}; only files can be read")
        os.set_blocking(fd, True)
        return fd, st.st_size

    # -- writing -----------------------------------------------------------------------------------------------
    def mkdir(self, path: str, uid: int | None = None, gid: int | None = None, mode: int | None = None,
              force: bool = False) -> dict[str, Any]:
        """Make a directory; without `force` its parent must exist and it must not; `force` makes parents and
        accepts an existing directory."""
        parts = parts_of(path)
        if not parts:
            if force:
                return self.stat("/")
            raise Conflict("path '/' exists (the volume root)")
        for i in range(1 if force else len(parts), len(parts) + 1):
            last = i == len(parts)
            with self.dir_fd(parts[:i - 1]) as parent:
                try:
                    os.mkdir(parts[i - 1], 0o700, dir_fd=parent)
                except FileExistsError:
                    st = os.stat(parts[i - 1], dir_fd=parent, follow_symlinks=False)
                    if last and not force:
                        raise Conflict(f"path {display(parts)!r} exists; pass force=true to accept it") from None
                    if not stat.S_ISDIR(st.st_mode) and not (not last and stat.S_ISLNK(st.st_mode)):
                        raise Conflict(f"path {display(parts[:i])!r} exists and is not a directory") from None
                    continue
                self._own(parent, parts[i - 1], uid, gid, 0o755 if mode is None else mode)
        with self.dir_fd(parts[:-1]) as parent:
            return self._entry(parent, parts)

    def _own(self, parent: int, name: str, uid: int | None, gid: int | None, mode: int | None) -> None:
        """chown/chmod one entry we just made or were asked to change, never through a symlink."""
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                if mode is not None:
                    raise BadRequest(f"{name!r} is a symlink: its mode cannot be changed")
                os.chown(name, DEFAULT_UID if uid is None else uid, -1 if gid is None else gid, dir_fd=parent,
                         follow_symlinks=False)
                return
            proc = f"/proc/self/fd/{fd}"  # the inode itself, whatever the name points at by now
            os.chown(proc, DEFAULT_UID if uid is None else uid, DEFAULT_GID if gid is None else gid)
            if mode is not None:
                os.chmod(proc, mode)
        finally:
            os.close(fd)

    def chattr(self, path: str, uid: int | None, gid: int | None, mode: int | None) -> dict[str, Any]:
        parts = parts_of(path)
        if not parts:
            raise BadRequest("the volume root's owner and mode cannot be changed")
        with self.dir_fd(parts[:-1]) as parent:
            try:
                fd = os.open(parts[-1], os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
            except FileNotFoundError:
                raise NotFound(f"path {display(parts)!r} not found in the volume") from None
            try:
                st = os.fstat(fd)
                if stat.S_ISLNK(st.st_mode) and mode is not None:
                    raise BadRequest(f"path {display(parts)!r} is a symlink: its mode cannot be changed")
                proc = f"/proc/self/fd/{fd}"
                if uid is not None or gid is not None:
                    if stat.S_ISLNK(st.st_mode):
                        os.chown(parts[-1], -1 if uid is None else uid, -1 if gid is None else gid,
                                 dir_fd=parent, follow_symlinks=False)
                    else:
                        os.chown(proc, -1 if uid is None else uid, -1 if gid is None else gid)
                if mode is not None:
                    os.chmod(proc, mode)
            finally:
                os.close(fd)
            return self._entry(parent, parts)

    def remove(self, path: str) -> None:
        """Remove a file, symlink (not its target) or directory with everything in it."""
        parts = parts_of(path)
        if not parts:
            raise BadRequest("the volume root cannot be removed (destroy the volume instead)")
        with self.dir_fd(parts[:-1]) as parent:
            try:
                st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                raise NotFound(f"path {display(parts)!r} not found in the volume") from None
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(parts[-1], dir_fd=parent)  # fd-based: never follows a symlink out
            else:
                os.unlink(parts[-1], dir_fd=parent)

    def used_bytes(self) -> int:
        total = 0
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                except OSError:
                    pass
        return total

    def free_bytes(self) -> int:
        vfs = os.statvfs(self.root)
        free = vfs.f_bavail * vfs.f_frsize
        if self.quota is not None:
            free = min(free, max(0, self.quota - self.used_bytes()))
        return free

    def begin_upload(self, path: str, force: bool, length: int | None) -> Upload:
        """Check where a file is to be written (its parents are made, an existing file needs `force`, the length
        must fit) and open its upload file."""
        parts = parts_of(path)
        if not parts:
            raise BadRequest("path '/' is a directory, not a file")
        if length is not None and length > self.free_bytes():
            raise PayloadTooLarge(f"the upload ({length} bytes) exceeds the volume's free space "
                                  f"({self.free_bytes()} bytes)")
        try:
            with self.dir_fd(parts[:-1]):
                pass
        except NotFound:
            self.mkdir(display(parts[:-1]), force=True)  # parents are made, as the sandbox's files.write does
        with self.dir_fd(parts[:-1]) as parent:
            try:
                st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    raise Conflict(f"path {display(parts)!r} is a directory")
                if not force:
                    raise Conflict(f"path {display(parts)!r} exists; pass force=true to overwrite it")
            except FileNotFoundError:
                pass
        self.uploads.mkdir(mode=0o700, exist_ok=True)
        tmp = self.uploads / f"up-{os.urandom(8).hex()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        allowed = self.free_bytes() if self.quota is not None else None
        return Upload(self, parts, tmp, fd, allowed)


@dataclass
class Upload:
    """A file being written: chunks go to `tmp` (outside the volume root, same filesystem); commit renames it over
    the target, abort removes it. Out of space (ENOSPC, or the `dir` backend's quota) is a PayloadTooLarge."""

    volume: VolumeRoot
    parts: list[str]
    tmp: Path
    fd: int
    allowed: int | None
    written: int = 0

    def write(self, chunk: bytes) -> None:
        self.written += len(chunk)
        if self.allowed is not None and self.written > self.allowed:
            raise PayloadTooLarge(f"the upload exceeds the volume's quota ({self.volume.quota} bytes)")
        view = memoryview(chunk)
        try:
            while view:
                n = os.write(self.fd, view)
                view = view[n:]
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise PayloadTooLarge(f"the volume is full: the upload did not fit after {self.written - len(view)}"
                                      " bytes; nothing was changed") from None
            raise

    def commit(self, uid: int | None, gid: int | None, mode: int | None) -> dict[str, Any]:
        os.fchown(self.fd, DEFAULT_UID if uid is None else uid, DEFAULT_GID if gid is None else gid)
        os.fchmod(self.fd, 0o644 if mode is None else mode)
        os.close(self.fd)
        self.fd = -1
        with self.volume.dir_fd(self.parts[:-1]) as parent:
            up = os.open(self.volume.uploads, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.rename(self.tmp.name, self.parts[-1], src_dir_fd=up, dst_dir_fd=parent)
            except IsADirectoryError:
                raise Conflict(f"path {display(self.parts)!r} is a directory") from None
            finally:
                os.close(up)
            return self.volume._entry(parent, self.parts)

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass
