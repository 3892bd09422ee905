"""API keys: their format, their hash, and issuing one (the database keeps only the hash: keepstate.db.repos.Keys).

    record, secret = await issue(Keys(db), "ci-runner")    # `secret` is shown once, never stored
    await find(Keys(db), secret)                           # the active key, or None
"""

from __future__ import annotations

import hashlib
import re
import secrets

from keepstate.db.records import KeyRecord
from keepstate.db.repos import Keys

# E2B's format: some SDK releases (e2b 2.45) refuse any other before sending a request. Keys issued before in our
# own format ("ks_" + 40 hex) are still accepted: a key is looked up by its hash, whatever its shape.
API_KEY_FORMAT = re.compile(r"\Ae2b_[0-9a-f]+\Z")


def new_api_key() -> str:
    return "e2b_" + secrets.token_hex(20)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def issue(keys: Keys, name: str, max_sandboxes: int | None = None,
                secret: str | None = None) -> tuple[KeyRecord, str]:
    """A new key called `name` and its secret (a new one unless given)."""
    secret = secret or new_api_key()
    return await keys.create(name, hash_key(secret), secret[:8], max_sandboxes), secret


async def find(keys: Keys, secret: str) -> KeyRecord | None:
    return await keys.find(hash_key(secret))
