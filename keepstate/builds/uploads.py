"""Build-context uploads: signed URLs the SDK PUTs to without an API key, stored by their `filesHash`.

The SDK sends no Authorization header with the PUT (it is written for S3's presigned URLs), so the URL carries
its own authority: an HMAC over the hash and an expiry, under a key only this server's home holds.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import tempfile
import time
from pathlib import Path

from keepstate.errors import BadRequest, Unauthorized

from .steps import HASH_RE

URL_TTL = 3600
PREFIX = "/templates/uploads/"


class Uploads:
    def __init__(self, home: Path) -> None:
        self.dir = home / "template-uploads"
        self.dir.mkdir(parents=True, exist_ok=True)
        key_file = self.dir / ".key"
        if not key_file.exists():
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        self._key = bytes.fromhex(key_file.read_text().strip())

    def path(self, files_hash: str) -> Path:
        if not HASH_RE.match(files_hash):
            raise BadRequest("a files hash is 64 lowercase hex digits")
        return self.dir / files_hash

    def present(self, files_hash: str) -> bool:
        return self.path(files_hash).is_file()

    def _sign(self, files_hash: str, expires: int) -> str:
        return hmac.new(self._key, f"{files_hash}:{expires}".encode(), hashlib.sha256).hexdigest()

    def url(self, base: str, files_hash: str) -> str:
        expires = int(time.time()) + URL_TTL
        return f"{base.rstrip('/')}{PREFIX}{files_hash}?expires={expires}&signature={self._sign(files_hash, expires)}"

    def check(self, files_hash: str, expires: str, signature: str) -> None:
        self.path(files_hash)
        try:
            when = int(expires)
        except ValueError:
            raise Unauthorized("upload URL without a valid `expires`") from None
        if when < time.time():
            raise Unauthorized("upload URL expired: ask GET /templates/{id}/files/{hash} for a new one")
        if not hmac.compare_digest(self._sign(files_hash, when), signature):
            raise Unauthorized("upload URL signature is invalid")

    def receive(self, files_hash: str) -> tuple[int, Path]:
        """A temporary file to write the body into (fd, path); `commit` renames it into place."""
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".upload-")
        return fd, Path(tmp)

    def commit(self, files_hash: str, tmp: Path) -> None:
        os.replace(tmp, self.path(files_hash))
