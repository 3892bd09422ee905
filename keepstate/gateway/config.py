"""Gateway configuration: providers, data directory, prices, budgets. File format in docs/design/gateway.md."""

from __future__ import annotations

import fnmatch
import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from keepstate import config as ks_config

ProviderKind = Literal["openai", "anthropic"]


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ProviderConfig:
    name: str
    kind: ProviderKind
    base_url: str
    api_key: str
    models: tuple[str, ...]
    stats_url: str | None = None  # a provider-side count of calls and tokens, for `ledger reconcile`
    api_key_env: str | None = None  # the environment variable the key was read from, if it was

    def serves(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, m) for m in self.models)

    def listed_models(self) -> list[str]:
        return [m for m in self.models if not any(c in m for c in "*?[")]


@dataclass
class GatewayConfig:
    providers: list[ProviderConfig] = field(default_factory=list)
    data_dir: Path = field(default_factory=ks_config.home)
    price_table: Path | None = None
    key_budgets_usd: dict[str, float] = field(default_factory=dict)
    session_budgets_usd: dict[str, float] = field(default_factory=dict)
    default_max_output_tokens: int = 4096
    upstream_timeout_s: float = 600.0
    upstream_connect_timeout_s: float = 10.0
    # How long a request from a sandbox address that is not bound yet waits for its binding (a restored
    # instance runs a moment before the server registers it) before it is answered 503.
    binding_wait_s: float = 10.0

    def provider_for(self, kind: ProviderKind, model: str) -> ProviderConfig | None:
        for p in self.providers:
            if p.kind == kind and p.serves(model):
                return p
        return None

    def forget_key_variables(self) -> None:
        """Drop the environment variables the providers' keys were read from (`api_key_env`) from this process's
        environment, as the server does KEEPSTATE_SECRETS_KEY: the processes it starts then never hold them."""
        for provider in self.providers:
            if provider.api_key_env:
                os.environ.pop(provider.api_key_env, None)

    @classmethod
    def from_file(cls, path: str | Path) -> GatewayConfig:
        path = Path(path)
        try:
            text = path.read_text()
            doc = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read gateway config {path}: {e}") from e
        return cls.from_dict(doc, base=path.parent)

    @classmethod
    def from_dict(cls, doc: dict[str, Any], base: Path | None = None) -> GatewayConfig:
        providers = [_provider(p) for p in doc.get("providers", [])]
        names = [p.name for p in providers]
        if len(set(names)) != len(names):
            raise ConfigError(f"provider names must be unique, got {names}")
        budgets = doc.get("budgets", {})
        cfg = cls(providers=providers)
        if "data_dir" in doc:
            cfg.data_dir = _path(doc["data_dir"], base)
        if doc.get("price_table"):
            cfg.price_table = _path(doc["price_table"], base)
        cfg.key_budgets_usd = {str(k): float(v) for k, v in budgets.get("keys", {}).items()}
        cfg.session_budgets_usd = {str(k): float(v) for k, v in budgets.get("sessions", {}).items()}
        cfg.default_max_output_tokens = int(doc.get("default_max_output_tokens", cfg.default_max_output_tokens))
        cfg.upstream_timeout_s = float(doc.get("upstream_timeout_s", cfg.upstream_timeout_s))
        cfg.binding_wait_s = float(doc.get("binding_wait_s", cfg.binding_wait_s))
        return cfg


def _path(value: str, base: Path | None) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() or base is None else base / p


def _provider(p: dict[str, Any]) -> ProviderConfig:
    try:
        name, kind, base_url = str(p["name"]), p["kind"], str(p["base_url"]).rstrip("/")
    except KeyError as e:
        raise ConfigError(f"provider entry {p!r} lacks {e}") from e
    if kind not in ("openai", "anthropic"):
        raise ConfigError(f"provider {name}: kind must be 'openai' or 'anthropic', not {kind!r}")
    key = p.get("api_key")
    if key is None and p.get("api_key_env"):
        key = os.environ.get(p["api_key_env"])
        if key is None:
            raise ConfigError(f"provider {name}: environment variable {p['api_key_env']} is not set")
    models = p.get("models") or ["*"]
    return ProviderConfig(name, kind, base_url, str(key or ""), tuple(models), p.get("stats_url") or None,
                          p.get("api_key_env") if p.get("api_key") is None else None)
