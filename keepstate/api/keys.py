"""Typed keys for what the application object carries (aiohttp AppKeys)."""

from __future__ import annotations

from aiohttp import web

from keepstate.api.idempotent import IdempotentCreates
from keepstate.db.engine import Database
from keepstate.sandbox.manager import SandboxManager
from keepstate.sandbox.retention import Retention
from keepstate.secret import SecretStore
from keepstate.volume import Volumes

MANAGER: web.AppKey[SandboxManager] = web.AppKey("manager", SandboxManager)
DATABASE: web.AppKey[Database] = web.AppKey("database", Database)
ENVD_VERSION: web.AppKey[str] = web.AppKey("envd_version", str)
VOLUMES: web.AppKey[Volumes] = web.AppKey("volumes", Volumes)
SECRETS: web.AppKey[SecretStore] = web.AppKey("secrets", SecretStore)
DOMAIN: web.AppKey[str] = web.AppKey("domain", str)  # port URLs are <port>-<sandboxID>.<domain> (serve --domain)
TIMEOUT_LIMIT: web.AppKey[int] = web.AppKey("timeout_limit", int)  # serve --max-timeout, seconds (0: none)
RETENTION: web.AppKey[Retention] = web.AppKey("retention", Retention)  # serve --paused-retention's loop
IDEMPOTENT: web.AppKey[IdempotentCreates] = web.AppKey("idempotent", IdempotentCreates)  # api/idempotent.py
API_KEY_ID: web.RequestKey[str] = web.RequestKey("api_key_id", str)  # the caller's key, set by the middleware
