"""Secrets (E2B's `/secrets`): values sealed at rest (crypto.py), records and the proxy's lookups (store.py)."""

from .crypto import SecretKeyError
from .store import SecretStore

__all__ = ["SecretKeyError", "SecretStore"]
