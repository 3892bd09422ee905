"""The secrets: E2B's `/secrets` records, their values sealed in the database (crypto.py), write-only.

A value goes in through `create`/`update` and comes out only through `value(name)`, which the egress proxy calls
on the host for each request it rewrites (docs/design/network.md, "Secrets"). Nothing else here returns, logs or
puts a value into an error message: every read surface returns a SecretRecord, which has no value field.

Names are lower-cased before storage (E2B's rule: the SDK documents it), so lookups ignore case; the `sec_` prefix
is reserved for IDs, so an argument that is "an ID or a name" is never ambiguous.
"""

from __future__ import annotations

import builtins
import re
import secrets
import time
from pathlib import Path

from keepstate.db.engine import Database
from keepstate.db.records import SecretRecord
from keepstate.db.repos import Secrets
from keepstate.errors import BadRequest, NotFound

from .crypto import Sealer, SecretKeyError, load_key

ID_PREFIX = "sec_"
MAX_NAME = 128
MAX_VALUE_BYTES = 64 << 10
MAX_META_KEYS, MAX_META_KEY_BYTES, MAX_META_VALUE_BYTES, MAX_META_BYTES = 32, 128, 1024, 8192
MAX_PAGE, DEFAULT_PAGE = 100, 100
# What the SDK refuses ({, } and control characters: the name goes into `${e2b.secrets.NAME}`), whitespace, and
# what cannot travel as one path segment of `/secrets/{name}` as the SDK sends it (/ ? # % \).
_BAD_NAME = re.compile(r"[{}\x00-\x1f\x7f-\x9f/?#%\\]|\s")
# Header values (where the proxy substitutes a value) cannot hold these (RFC 9110 5.5): refusing them here keeps a
# secret from ever splitting a request the proxy writes.
_BAD_VALUE = re.compile(r"[\r\n\x00]")


def check_name(name: object) -> str:
    """A new secret's name, lower-cased; BadRequest says what is allowed."""
    if not isinstance(name, str) or not name:
        raise BadRequest("`name` must be a non-empty string")
    if len(name) > MAX_NAME:
        raise BadRequest(f"`name` must be at most {MAX_NAME} characters, got {len(name)}")
    bad = _BAD_NAME.search(name)
    if bad:
        raise BadRequest(f"`name` cannot contain {bad.group()!r}: a secret name has no whitespace, control "
                         "characters, '{', '}', '/', '?', '#', '%' or '\\' (it goes into the "
                         "'${e2b.secrets.<name>}' placeholder and into /secrets/<name>)")
    if set(name) == {"."}:
        raise BadRequest("`name` cannot be only dots")
    low = name.lower()
    if low.startswith(ID_PREFIX):
        raise BadRequest(f"`name` cannot start with '{ID_PREFIX}': that prefix is reserved for secret IDs")
    return low


def check_value(value: object) -> str:
    """A value to seal. The messages never quote it."""
    if not isinstance(value, str) or not value:
        raise BadRequest("`value` must be a non-empty string")
    size = len(value.encode("utf-8"))
    if size > MAX_VALUE_BYTES:
        raise BadRequest(f"`value` must be at most {MAX_VALUE_BYTES} bytes (UTF-8), got {size}")
    if _BAD_VALUE.search(value):
        raise BadRequest("`value` cannot contain CR, LF or NUL: secrets are substituted into HTTP header values")
    return value


def check_metadata(metadata: object) -> dict[str, str] | None:
    """Metadata as E2B limits it (at most 32 entries, keys up to 128 bytes, values up to 1024, 8192 in all);
    None when absent (an update then keeps the stored metadata)."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise BadRequest("`metadata` must be an object of string values")
    if len(metadata) > MAX_META_KEYS:
        raise BadRequest(f"`metadata` may have at most {MAX_META_KEYS} entries, got {len(metadata)}")
    total = 0
    for k, v in metadata.items():
        if not isinstance(v, str):
            raise BadRequest(f"`metadata` values must be strings (key {k[:64]!r})")
        klen, vlen = len(k.encode("utf-8")), len(v.encode("utf-8"))
        if not k:
            raise BadRequest("`metadata` keys must be non-empty")
        if klen > MAX_META_KEY_BYTES:
            raise BadRequest(f"`metadata` keys must be at most {MAX_META_KEY_BYTES} bytes, got {klen}")
        if vlen > MAX_META_VALUE_BYTES:
            raise BadRequest(f"`metadata` value of key {k!r} must be at most {MAX_META_VALUE_BYTES} bytes, "
                             f"got {vlen}")
        total += klen + vlen
    if total > MAX_META_BYTES:
        raise BadRequest(f"`metadata` must be at most {MAX_META_BYTES} bytes in all (keys and values), got {total}")
    return dict(metadata)


def _decode_token(token: str | None) -> int:
    if not token:
        return 0
    if not token.isascii() or not token.isdigit() or len(token) > 18:
        raise BadRequest("invalid `nextToken`: pass the previous page's X-Next-Token as it came")
    return int(token)


class SecretStore:
    """create / update (a new version) / get / list / delete, and the proxy's `exists` and `value`. Call
    `check_key` once before anything else (the server does, at start)."""

    def __init__(self, db: Database, sealer: Sealer) -> None:
        self.repo = Secrets(db)
        self.where = db.url.shown
        self._sealer = sealer

    @classmethod
    def open(cls, db: Database, key_file: Path) -> SecretStore:
        """The store with the operator's key (crypto.load_key; the server's default is `<home>/secrets.key`)."""
        return cls(db, Sealer(load_key(key_file)))

    async def check_key(self) -> None:
        """Refuse, at once and clearly, a key other than the one the stored secrets were sealed with."""
        known = await self.repo.key_fingerprint()
        if known == self._sealer.fingerprint:
            return
        stored = await self.repo.count()
        if known is not None and stored:
            raise SecretKeyError(f"the secrets key is not the one the {stored} secret(s) in {self.where} "
                                 "were sealed with: start the server with the same --secrets-key-file (or "
                                 "KEEPSTATE_SECRETS_KEY) as before")
        await self.repo.set_key_fingerprint(self._sealer.fingerprint)

    # -- the API's operations -------------------------------------------------------------------------------------
    async def create(self, name: object, value: object, metadata: object = None) -> SecretRecord:
        low, text, meta = check_name(name), check_value(value), check_metadata(metadata)
        now = time.time()
        secret_id = ID_PREFIX + secrets.token_hex(10)
        row = SecretRecord(secret_id=secret_id, name=low, current_version=1, metadata=meta or {}, created_at=now,
                           updated_at=now)
        return await self.repo.put(row, self._sealer.seal(secret_id, 1, text))

    async def update(self, ref: str, value: object, metadata: object = None) -> SecretRecord:
        """Store `value` as the secret's next version; metadata, when given, replaces the stored one."""
        text, meta = check_value(value), check_metadata(metadata)
        found = await self.get(ref)
        version = await self.repo.add_version(found.secret_id,
                                              lambda version: self._sealer.seal(found.secret_id, version, text),
                                              meta, time.time())
        row = await self.repo.get(found.secret_id) if version is not None else None
        if row is None:
            raise NotFound(f"secret {ref} not found")
        return row

    async def find(self, ref: str) -> SecretRecord | None:
        """A secret by ID (`sec_...`) or by name, any case."""
        low = ref.lower()
        if low.startswith(ID_PREFIX):
            return await self.repo.get(low)
        return await self.repo.by_name(low)

    async def get(self, ref: str) -> SecretRecord:
        found = await self.find(ref)
        if found is None:
            raise NotFound(f"secret {ref[:200]} not found")
        return found

    async def list(self, limit: int = DEFAULT_PAGE,
                   next_token: str | None = None) -> tuple[builtins.list[SecretRecord], str | None]:
        """One page, oldest first, and the token of the next (None: this is the last)."""
        if not 1 <= limit <= MAX_PAGE:
            raise BadRequest(f"`limit` must be from 1 to {MAX_PAGE}")
        rows = await self.repo.page(_decode_token(next_token), limit + 1)
        if len(rows) > limit:
            return rows[:limit], str(rows[limit - 1].seq)
        return rows, None

    async def delete(self, ref: str) -> bool:
        found = await self.find(ref)
        return found is not None and await self.repo.delete(found.secret_id)

    # -- the egress service's questions -----------------------------------------------------------------------
    async def exists(self, name: str) -> bool:
        """Whether a secret of this name exists (a policy naming one that does not is a 400)."""
        return await self.repo.by_name(name.lower()) is not None

    async def value(self, name: str) -> str | None:
        """The current version's value, decrypted; None when there is no such secret. The one way a value leaves
        the store: for the egress proxy, on the host, per request. SecretKeyError if it does not decrypt."""
        row = await self.repo.by_name(name.lower())
        if row is None:
            return None
        sealed = await self.repo.sealed(row.secret_id, row.current_version)
        if sealed is None:  # deleted between the two reads
            return None
        return self._sealer.open(row.secret_id, row.current_version, sealed)
