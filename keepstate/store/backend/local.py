"""A repository in a local directory. Writes are atomic: temporary file, fsync, rename, fsync of the directory."""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path

from keepstate.store.backend import Backend, ObjectInfo, check_key
from keepstate.store.errors import BackendError, ObjectNotFound, ShortRead

TEMP_PREFIX = ".tmp-"


class LocalBackend(Backend):
    def __init__(self, path: Path | str) -> None:
        self.root = Path(path).absolute()

    @property
    def location(self) -> str:
        return self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def save(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self.save_parts(key, [data])

    def save_parts(self, key: str, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        path = self._path(key)
        tmp = path.parent / f"{TEMP_PREFIX}{secrets.token_hex(8)}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, [memoryview(p).cast("B") for p in parts if len(p)])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
            self._fsync_dir(path.parent)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise BackendError(f"cannot write {key} in {self.location}: {exc}") from exc

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                if offset:
                    f.seek(offset)
                data = f.read() if length is None else f.read(length)
        except FileNotFoundError as exc:
            raise ObjectNotFound(key, self.location) from exc
        except OSError as exc:
            raise BackendError(f"cannot read {key} in {self.location}: {exc}") from exc
        if length is not None and len(data) != length:
            raise ShortRead(f"short read of {key} in {self.location}: wanted {length} bytes at {offset}, "
                               f"got {len(data)}")
        return data

    def stat(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError as exc:
            raise ObjectNotFound(key, self.location) from exc
        except OSError as exc:
            raise BackendError(f"cannot stat {key} in {self.location}: {exc}") from exc

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Walk only the directory the prefix lies in, so listing refs/ does not walk every pack.
        top = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not top.is_dir():
            return
        for dirpath, _dirnames, filenames in os.walk(top):
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if name.startswith(TEMP_PREFIX):
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if not key.startswith(prefix):
                    continue
                try:
                    size = os.stat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    continue  # removed while listing
                yield ObjectInfo(key, size)

    def remove(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise BackendError(f"cannot remove {key} in {self.location}: {exc}") from exc

    def remove_leftovers(self) -> int:
        freed = 0
        if not self.root.is_dir():
            return 0
        for dirpath, _dirnames, filenames in os.walk(self.root):
            for name in filenames:
                if name.startswith(TEMP_PREFIX):
                    path = os.path.join(dirpath, name)
                    try:
                        freed += os.stat(path).st_size
                        os.unlink(path)
                    except OSError as exc:
                        if exc.errno != errno.ENOENT:
                            raise BackendError(f"cannot remove leftover {path}: {exc}") from exc
        return freed


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Write every view, in order, with as few system calls as writev allows."""
    i = 0
    while i < len(views):
        batch = views[i:i + 1024]  # IOV_MAX
        n = os.writev(fd, batch)
        for v in batch:  # drop what was written; a short write leaves the rest of a view to go
            if n >= len(v):
                n -= len(v)
                i += 1
            else:
                views[i] = v[n:]
                break

