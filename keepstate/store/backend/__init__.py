"""The one interface between the store and where its objects live.

Contract every backend honours (checked by tests/store/test_backend_conformance.py):

- Keys are relative POSIX paths such as ``packs/ab/ab12...``; no leading ``/``, no ``..``.
- ``save(key, data)`` makes the object appear atomically: readers and ``list`` see the old object (or none) or
  the whole new one, never a part. Saving an existing key replaces it.
- ``load(key, offset, length)`` returns exactly the requested bytes (the rest of the object when ``length`` is
  None); a range reaching past the end is a BackendError; a missing object raises ObjectNotFound.
- ``stat(key)`` returns the size or raises ObjectNotFound.
- ``list(prefix)`` yields every complete object whose key starts with ``prefix``, in no particular order.
- ``remove(key)`` deletes; removing a missing object is not an error.
- ``remove_leftovers()`` deletes the remains of interrupted saves (temporary files) and returns how many bytes
  it freed; only gc calls it, under the exclusive lock.
- Methods are safe to call from several threads at once.
"""

from __future__ import annotations

import abc
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


class Backend(abc.ABC):
    """Where a repository's objects live. See the module docstring for the contract."""

    # The longest range a reader should ask for in one load(); None: as long as useful (each request costs a
    # round trip).
    read_span: int | None = None

    @property
    @abc.abstractmethod
    def location(self) -> str:
        """A URL naming the location, for messages (never includes secrets)."""

    @abc.abstractmethod
    def save(self, key: str, data: bytes | bytearray | memoryview) -> None: ...

    def save_parts(self, key: str, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        """save() of the parts' concatenation; a backend that can write them without joining them does."""
        self.save(key, b"".join(parts))

    @abc.abstractmethod
    def load(self, key: str, offset: int = 0, length: int | None = None) -> bytes: ...

    @abc.abstractmethod
    def stat(self, key: str) -> int: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]: ...

    @abc.abstractmethod
    def remove(self, key: str) -> None: ...

    def remove_leftovers(self) -> int:
        return 0

    def close(self) -> None:  # noqa: B027 - optional: only a backend that holds connections overrides it
        pass

    def exists(self, key: str) -> bool:
        from keepstate.store.errors import ObjectNotFound

        try:
            self.stat(key)
        except ObjectNotFound:
            return False
        return True


def check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid object key {key!r}")
    return key


def backend_from_url(url: str) -> Backend:
    """``file:///path`` (or a plain path) → LocalBackend; ``s3://bucket/prefix?endpoint=URL&region=R`` → S3Backend.

    S3 credentials come from the URL's query (``access_key``, ``secret_key``) or else from the environment
    (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, or ``KEEPSTATE_S3_ACCESS_KEY`` / ``KEEPSTATE_S3_SECRET_KEY``).
    """
    import os

    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme in ("", "file"):
        if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URL must be file:///absolute/path, got {url!r}")
        from keepstate.store.backend.local import LocalBackend

        return LocalBackend(Path(urllib.parse.unquote(parsed.path)))
    if parsed.scheme == "s3":
        from keepstate.store.backend.s3 import S3Backend

        query = dict(urllib.parse.parse_qsl(parsed.query))
        if not parsed.netloc:
            raise ValueError(f"S3 URL needs a bucket: s3://BUCKET/PREFIX?endpoint=URL, got {url!r}")
        access = (query.get("access_key") or os.environ.get("KEEPSTATE_S3_ACCESS_KEY")
                  or os.environ.get("AWS_ACCESS_KEY_ID"))
        secret = (query.get("secret_key") or os.environ.get("KEEPSTATE_S3_SECRET_KEY")
                  or os.environ.get("AWS_SECRET_ACCESS_KEY"))
        return S3Backend(
            endpoint=query.get("endpoint"),
            bucket=parsed.netloc,
            prefix=parsed.path.strip("/"),
            access_key=access,
            secret_key=secret,
            region=query.get("region", os.environ.get("AWS_REGION", "us-east-1")),
        )
    raise ValueError(f"unsupported store URL {url!r}: use file:///path or s3://bucket/prefix?endpoint=...")


__all__ = ["Backend", "ObjectInfo", "backend_from_url", "check_key"]
