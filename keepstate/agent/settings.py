"""The sandbox's settings: template defaults from disk, then what the host sets through `POST /init`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_TEMPLATE_PATH = "/etc/keepstate/template.json"


class SettingsError(ValueError):
    """A template file or /init body that cannot be used."""


@dataclass(frozen=True)
class ServiceSpec:
    """A long-running child the agent keeps alive (e.g. the code interpreter)."""

    name: str
    command: list[str]
    port: int | None = None
    user: str = "root"
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Template:
    """Defaults baked into the sandbox image at /etc/keepstate/template.json."""

    user: str = "root"
    workdir: str = ""
    env: dict[str, str] = field(default_factory=dict)
    services: list[ServiceSpec] = field(default_factory=list)


def _str_map(value: Any, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise SettingsError(f"{what} must be an object of string values")
    return dict(value)


def parse_template(data: Any) -> Template:
    if not isinstance(data, dict):
        raise SettingsError("template must be a JSON object")
    services = []
    for raw in data.get("services") or []:
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise SettingsError("each service needs a string 'name'")
        command = raw.get("command")
        if not isinstance(command, list) or not command or not all(isinstance(c, str) for c in command):
            raise SettingsError(f"service {raw['name']!r}: 'command' must be a non-empty list of strings")
        port = raw.get("port")
        services.append(
            ServiceSpec(
                name=raw["name"],
                command=command,
                port=port if isinstance(port, int) else None,
                user=str(raw.get("user") or "root"),
                env=_str_map(raw.get("env"), f"service {raw['name']!r} env"),
            )
        )
    return Template(
        user=str(data.get("user") or "root"),
        workdir=str(data.get("workdir") or ""),
        env=_str_map(data.get("env"), "template env"),
        services=services,
    )


def load_template(path: str | Path) -> Template:
    """The template at `path`, or the built-in defaults (root, no services) when the file does not exist."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        return Template()
    try:
        return parse_template(json.loads(text))
    except json.JSONDecodeError as e:
        raise SettingsError(f"{p}: invalid JSON: {e}") from e


@dataclass(frozen=True)
class InitRequest:
    """A parsed `POST /init` body; None means "leave unchanged"."""

    access_token: str | None
    env_vars: dict[str, str]
    default_user: str | None
    default_workdir: str | None
    identity: dict[str, Any] | None = None  # sandboxId, sessionId and, after a fork, the fork's origin
    network: dict[str, str] | None = None  # resolvConf, caBundle (network_setup.py)


def parse_init(data: Any) -> InitRequest:
    if not isinstance(data, dict):
        raise SettingsError("body must be a JSON object")

    def opt_str(key: str) -> str | None:
        value = data.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise SettingsError(f"{key} must be a string")
        return value

    identity = {k: data[k] for k in ("sandboxId", "sessionId", "fork") if data.get(k) is not None}
    network = data.get("network")
    if network is not None:
        if not isinstance(network, dict):
            raise SettingsError("network must be an object")
        network = _str_map({k: v for k, v in network.items() if k in ("resolvConf", "caBundle")}, "network")
    return InitRequest(
        access_token=opt_str("accessToken"),
        env_vars=_str_map(data.get("envVars"), "envVars"),
        default_user=opt_str("defaultUser") or None,
        default_workdir=opt_str("defaultWorkdir") or None,
        identity=identity or None,
        network=network or None,
    )


IDENTITY_FILE = "/run/keepstate/identity.json"


def write_identity(identity: dict[str, Any], path: str = IDENTITY_FILE) -> None:
    """Tell processes inside who they are now: a fork finds a new sandboxId and a `fork` entry here.

    After a fork every copy also mixes fresh entropy into the kernel's pool (gVisor serves /dev/urandom
    from the host, so this is belt and braces); user-space PRNGs seeded before the fork are the user's to reseed.
    """
    import os

    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(identity, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        if identity.get("fork"):
            with open("/dev/urandom", "wb") as r:
                r.write(os.urandom(64))
    except OSError:
        pass  # host mode without /run, or a read-only /run: identity is informative only


class SandboxSettings:
    """Mutable, process-wide settings. Until /init sets a token the agent accepts every request."""

    def __init__(self, template: Template) -> None:
        self.template = template
        self.access_token: str | None = None
        self.default_user: str = template.user
        self.default_workdir: str = template.workdir
        self.env_vars: dict[str, str] = dict(template.env)

    def apply(self, init: InitRequest) -> None:
        if init.access_token is not None:
            # An empty token clears it: the host may hand a resumed sandbox back unsecured.
            self.access_token = init.access_token or None
        if init.network:
            from keepstate.agent import network_setup

            try:  # the CA variables first: the host's envVars may set their own
                self.env_vars.update(network_setup.apply(init.network))
            except OSError:
                pass  # a read-only root: the sandbox keeps its template's resolver and trust
        self.env_vars.update(init.env_vars)
        if init.default_user is not None:
            self.default_user = init.default_user
        if init.default_workdir is not None:
            self.default_workdir = init.default_workdir
        if init.identity:
            write_identity(init.identity)
