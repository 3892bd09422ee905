"""A sandbox's files as changes against its template, for a filesystem-only pause (docs/design/sandbox-disk.md).

`GET /keepstate/files` streams them as one tar (entries, and OCI whiteouts `.wh.<name>` for deletions);
`PUT /keepstate/files` applies such a tar to a freshly booted sandbox of the same template build. Both are the
host's: the router refuses them to clients.

Which entries changed is told by comparing each with the template's root, seen read-only at TEMPLATE_VIEW: gVisor's
overlay shows an entry that was never copied up with its lower layer's attributes (mode, owner, size, mtime,
ctime), a copied-up one with a ctime of its own, and a change below a directory copies the directory up; so the
walk descends only into directories that differ.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import shutil
import signal
import stat
import sys
import tarfile
import threading
from collections.abc import Iterator
from typing import IO

from keepstate.agent.asgi import HTTPError, Receive, Send, iter_body, send_json
from keepstate.agent.mounts import mount_points
from keepstate.mountpoints import TEMPLATE_VIEW

WHITEOUT = ".wh."
_CHUNK = 1 << 20


# -- what changed -----------------------------------------------------------------------------------------------
def _same(a: os.stat_result, b: os.stat_result | None) -> bool:
    return b is not None and (a.st_mode, a.st_uid, a.st_gid, a.st_size, a.st_mtime_ns, a.st_ctime_ns) == (
        b.st_mode, b.st_uid, b.st_gid, b.st_size, b.st_mtime_ns, b.st_ctime_ns)


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def changes(root: str = "/", lower: str = TEMPLATE_VIEW,
            skip: set[str] | None = None) -> Iterator[tuple[str, str, os.stat_result | None]]:
    """("entry", path, stat) and ("whiteout", path, None), paths relative to `root`, parents before children and a
    directory's whiteouts before its entries."""
    skip = mount_points() if skip is None else skip
    root = root.rstrip("/") or "/"
    lower = lower.rstrip("/")

    def full(base: str, rel: str) -> str:
        return f"{base.rstrip('/')}/{rel}" if rel else (base or "/")

    def visit(rel: str) -> Iterator[tuple[str, str, os.stat_result | None]]:
        path = full(root, rel)
        st = _lstat(path)
        if st is None:
            return  # gone while we looked
        low = _lstat(full(lower, rel))
        if rel and _same(st, low):
            return  # never copied up: nothing below it changed either
        if rel:
            yield "entry", rel, st
        if not stat.S_ISDIR(st.st_mode):
            return
        try:
            names = sorted(os.listdir(path))
        except OSError:
            return
        if low is not None and stat.S_ISDIR(low.st_mode):
            with contextlib.suppress(OSError):
                for gone in sorted(set(os.listdir(full(lower, rel))) - set(names)):
                    yield "whiteout", f"{rel}/{gone}" if rel else gone, None
        for name in names:
            child = f"{rel}/{name}" if rel else name
            if full(root, child) in skip:
                continue
            yield from visit(child)

    yield from visit("")


# -- export -----------------------------------------------------------------------------------------------------
class _QueueWriter:
    """A write-only file that hands what tarfile writes to the event loop in chunks, with back-pressure."""

    def __init__(self, q: queue.Queue[bytes | None]) -> None:
        self.q = q
        self.buf = bytearray()

    def write(self, data: bytes) -> int:
        self.buf += data
        if len(self.buf) >= _CHUNK:
            self.q.put(bytes(self.buf))
            self.buf.clear()
        return len(data)

    def flush(self) -> None:
        if self.buf:
            self.q.put(bytes(self.buf))
            self.buf.clear()


def write_tar(out: IO[bytes] | _QueueWriter, root: str = "/", lower: str = TEMPLATE_VIEW,
              skip: set[str] | None = None) -> int:
    """Write the changes as a tar stream; return how many entries it holds."""
    count = 0
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT,  # type: ignore[call-overload]
                      copybufsize=_CHUNK) as tar:
        for kind, rel, st in changes(root, lower, skip):
            if kind == "whiteout":
                head, _, name = rel.rpartition("/")
                info = tarfile.TarInfo(f"{head}/{WHITEOUT}{name}" if head else WHITEOUT + name)
                tar.addfile(info)
                count += 1
                continue
            assert st is not None
            path = os.path.join(root, rel)
            if stat.S_ISSOCK(st.st_mode):
                continue  # a socket is a process's, gone with it
            try:
                info = tar.gettarinfo(path, arcname=rel)
            except OSError:
                continue  # gone while we looked
            if info is None:
                continue
            info.mtime = st.st_mtime_ns / 1e9
            if info.isreg():
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                except OSError:
                    continue
                with os.fdopen(fd, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
            count += 1
    out.flush()
    return count


@contextlib.contextmanager
def processes_stopped() -> Iterator[list[int]]:
    """Every process but this one and PID 1 stopped (SIGSTOP), so the files are taken at one moment; continued
    afterwards, whatever happens (the host destroys the instance next, or it runs on if the pause fails)."""
    me = os.getpid()
    stopped = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in (me, 1):
            with contextlib.suppress(OSError):
                os.kill(int(entry), signal.SIGSTOP)
                stopped.append(int(entry))
    try:
        yield stopped
    finally:
        for pid in stopped:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)


async def export(send: Send, root: str = "/", lower: str = TEMPLATE_VIEW, stop: bool = True) -> None:
    if not os.path.isdir(lower):
        raise HTTPError(501, f"this sandbox has no template view at {lower}: it cannot pause without memory")
    q: queue.Queue[bytes | None] = queue.Queue(maxsize=8)
    failure: list[BaseException] = []

    def produce() -> None:
        try:
            with processes_stopped() if stop else contextlib.nullcontext():
                write_tar(_QueueWriter(q), root, lower)
        except BaseException as exc:  # reported by truncating the stream: the host verifies it is whole
            failure.append(exc)
        finally:
            q.put(None)

    threading.Thread(target=produce, name="ks-files-export", daemon=True).start()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/x-tar")]})
    loop = asyncio.get_running_loop()
    while (chunk := await loop.run_in_executor(None, q.get)) is not None:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    if failure:
        raise failure[0]  # the response is cut, not ended: the host sees an incomplete body
    await send({"type": "http.response.body", "body": b""})


def export_stdout(root: str = "/", lower: str = TEMPLATE_VIEW) -> int:
    """`boot.py export-files`: what GET /keepstate/files sends, on stdout. The host's runtime runs it inside a
    sandbox whose agent may not answer (a reboot from files of a sandbox paused with memory)."""
    if not os.path.isdir(lower):
        print(f"this sandbox has no template view at {lower}", file=sys.stderr)
        return 69
    with processes_stopped():
        write_tar(sys.stdout.buffer, root, lower)
    return 0


# -- apply ------------------------------------------------------------------------------------------------------
class _QueueReader:
    """A read-only file fed by the event loop's request body chunks."""

    def __init__(self, q: queue.Queue[bytes | None]) -> None:
        self.q = q
        self.buf = bytearray()
        self.done = False

    def read(self, n: int = -1) -> bytes:
        while not self.done and (n < 0 or len(self.buf) < n):
            chunk = self.q.get()
            if chunk is None:
                self.done = True
            else:
                self.buf += chunk
        if n < 0:
            n = len(self.buf)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


def _remove(path: str) -> None:
    st = _lstat(path)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _safe(name: str) -> str:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise HTTPError(400, f"archive entry {name!r} is not a path inside the sandbox")
    return "/".join(parts)


def apply_tar(src: IO[bytes] | _QueueReader, root: str = "/", skip: set[str] | None = None) -> int:
    """Apply a tar written by write_tar under `root`; return how many entries it held."""
    skip = mount_points() if skip is None else skip
    dirs: list[tuple[str, tarfile.TarInfo]] = []
    count = 0
    with tarfile.open(fileobj=src, mode="r|", bufsize=_CHUNK) as tar:  # type: ignore[call-overload]
        for m in tar:
            rel = _safe(m.name)
            path = os.path.join(root, rel)
            if any(path == p or path.startswith(p.rstrip("/") + "/") for p in skip):
                continue
            count += 1
            head, _, base = rel.rpartition("/")
            if base.startswith(WHITEOUT):
                _remove(os.path.join(root, head, base[len(WHITEOUT):]))
                continue
            have = _lstat(path)
            if have is not None and not (m.isdir() and stat.S_ISDIR(have.st_mode)):
                _remove(path)
            if m.isdir():
                if have is None or not stat.S_ISDIR(have.st_mode):
                    os.mkdir(path, 0o700)
                dirs.append((path, m))  # its attributes last: entries below change its times
                continue
            if m.isreg():
                f = tar.extractfile(m)
                assert f is not None
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as out:
                    shutil.copyfileobj(f, out, _CHUNK)
            elif m.issym():
                os.symlink(m.linkname, path)
            elif m.islnk():
                os.link(os.path.join(root, _safe(m.linkname)), path)
            elif m.isfifo():
                os.mkfifo(path, 0o600)
            elif m.ischr() or m.isblk():
                kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK
                os.mknod(path, kind | 0o600, os.makedev(m.devmajor, m.devminor))
            else:
                continue
            if not m.islnk():
                _attributes(path, m)
    for path, m in reversed(dirs):
        _attributes(path, m)
    return count


def _attributes(path: str, m: tarfile.TarInfo) -> None:
    with contextlib.suppress(OSError):
        os.lchown(path, m.uid, m.gid)
    if not m.issym():
        os.chmod(path, m.mode)
    ns = int(m.mtime * 1e9)
    os.utime(path, ns=(ns, ns), follow_symlinks=False)


async def apply(receive: Receive, send: Send, root: str = "/") -> None:
    q: queue.Queue[bytes | None] = queue.Queue(maxsize=8)
    loop = asyncio.get_running_loop()
    work = loop.run_in_executor(None, apply_tar, _QueueReader(q), root)
    try:
        async for chunk in iter_body(receive):
            await loop.run_in_executor(None, q.put, chunk)
    finally:
        await loop.run_in_executor(None, q.put, None)
    try:
        count = await work
    except HTTPError:
        raise
    except (OSError, tarfile.TarError) as exc:
        raise HTTPError(500, f"applying the sandbox's files failed: {exc}") from exc
    await send_json(send, 200, {"entries": count})
