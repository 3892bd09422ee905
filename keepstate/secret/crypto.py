"""Secret values sealed at rest: AES-256-GCM under a key the operator holds, never in the catalog.

Why a key file and not a passphrase: the server must decrypt without a human (the egress proxy substitutes
values per request), so the key is a file the operator can keep off the catalog's disk and out of its backups
(`serve --secrets-key-file F`, default `<home>/secrets.key`, 32 random bytes made 0600 on first use), or the
environment variable KEEPSTATE_SECRETS_KEY (base64 of 32 bytes), which wins and is removed from the server's
environment once read, so that no child process (runsc, ip, nft) inherits it.

The associated data is the secret's ID and version: a ciphertext copied into another row (another secret, or
another version of the same one) fails to open, as does one altered by a single bit.

Sealed format: b"\\x01" (format), 12-byte random nonce, ciphertext with its 16-byte tag.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from keepstate.errors import KeepStateError

log = logging.getLogger("keepstate.secret")

ENV_VAR = "KEEPSTATE_SECRETS_KEY"
KEY_FILE = "secrets.key"
KEY_BYTES = 32
FORMAT = b"\x01"
NONCE_BYTES = 12


class SecretKeyError(KeepStateError):
    """The key is malformed or not the one the stored secrets were sealed with (a 500 if it reaches a handler;
    `keepstate serve` reports it and exits). Its messages name files and secret IDs, never a value or the key."""


def _decode_b64(text: str, where: str) -> bytes:
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise SecretKeyError(f"{where} is not base64 (expected base64 of {KEY_BYTES} random bytes, e.g. "
                             f"`head -c {KEY_BYTES} /dev/urandom | base64`)") from None
    if len(key) != KEY_BYTES:
        raise SecretKeyError(f"{where} decodes to {len(key)} bytes; an AES-256 key is {KEY_BYTES}")
    return key


def _read_file(path: Path) -> bytes:
    raw = path.read_bytes()
    if len(raw) == KEY_BYTES:
        key = raw
    else:  # also accepted: base64 text (what `openssl rand -base64 32 > F` writes)
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            raise SecretKeyError(f"secrets key file {path} holds {len(raw)} bytes; expected {KEY_BYTES} raw bytes "
                                 f"or their base64") from None
        key = _decode_b64(text, f"secrets key file {path}")
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("secrets key file %s is accessible to group or others (mode %o): chmod 600 it",
                    path, stat.S_IMODE(mode))
    return key


def _create_file(path: Path) -> bytes:
    """Make a new key file, 0600 from its first byte; a process that made it first wins (O_EXCL)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    key = os.urandom(KEY_BYTES)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic, and fails if another process made the file meanwhile
    except FileExistsError:
        return _read_file(path)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("made a new secrets key in %s (keep it: the secrets cannot be read without it)", path)
    return key


def load_key(path: Path) -> bytes:
    """The secrets key: KEEPSTATE_SECRETS_KEY if set (then dropped from the environment), else the file at
    `path`, made with 32 random bytes (mode 0600) when it does not exist."""
    text = os.environ.pop(ENV_VAR, None)
    if text is not None:
        return _decode_b64(text, f"environment variable {ENV_VAR}")
    try:
        return _read_file(path)
    except FileNotFoundError:
        return _create_file(path)
    except OSError as exc:
        raise SecretKeyError(f"cannot read secrets key file {path}: {exc.strerror}") from None


def fingerprint(key: bytes) -> str:
    """A public name of the key (a hash; it says nothing of the key), kept in the catalog so that a server
    started with another key says so at once instead of failing on each value."""
    return hashlib.sha256(b"keepstate secrets key\x00" + key).hexdigest()[:32]


def _aad(secret_id: str, version: int) -> bytes:
    return f"keepstate-secret\x00{secret_id}\x00{version}".encode()


class Sealer:
    """Seal and open one secret version's value with the server's key."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise SecretKeyError(f"an AES-256 key is {KEY_BYTES} bytes, not {len(key)}")
        self._aead = AESGCM(key)
        self.fingerprint = fingerprint(key)

    def seal(self, secret_id: str, version: int, value: str) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return FORMAT + nonce + self._aead.encrypt(nonce, value.encode("utf-8"), _aad(secret_id, version))

    def open(self, secret_id: str, version: int, sealed: bytes) -> str:
        """The value; SecretKeyError (naming the secret, never the value) when the ciphertext does not open."""
        if len(sealed) < 1 + NONCE_BYTES + 16 or sealed[:1] != FORMAT:
            raise SecretKeyError(f"secret {secret_id} version {version}: stored ciphertext is malformed")
        nonce, body = sealed[1:1 + NONCE_BYTES], sealed[1 + NONCE_BYTES:]
        try:
            return self._aead.decrypt(nonce, body, _aad(secret_id, version)).decode("utf-8")
        except InvalidTag:
            raise SecretKeyError(f"secret {secret_id} version {version} does not decrypt: it was sealed with "
                                 f"another key, or its stored row was altered or moved") from None
