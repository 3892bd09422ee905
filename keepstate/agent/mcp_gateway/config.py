"""E2B's `mcp` object → the servers to run (docs/design/mcp-gateway.md, "Config")."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Any

MAX_SERVERS = 64
GITHUB_ROOT = os.environ.get("MCP_GATEWAY_SERVERS_DIR", "/opt/mcp-servers")  # GitHub servers' clones
DEFAULT_PATHS = ["/home/user"]
_GITHUB = re.compile(r"^github/([A-Za-z0-9_.-]+)/([A-Za-z0-9_.-]+)$")


class ConfigError(ValueError):
    """The config cannot be run: the message names the key and why."""


@dataclass(frozen=True)
class ServerSpec:
    name: str  # the config's key
    command: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    clone: str | None = None  # a GitHub repository to clone into `cwd` first (unless it is there)
    install: str | None = None  # run once in `cwd` after the clone

    @property
    def program(self) -> str:
        """What must be installed for it to run (for `pull`)."""
        return "git" if self.clone else self.command


# name → (program, fixed arguments); `filesystem` adds its paths.
CATALOG: dict[str, tuple[str, list[str]]] = {
    "time": ("mcp-server-time", []),
    "fetch": ("mcp-server-fetch", []),
    "filesystem": ("mcp-server-filesystem", []),
    "memory": ("mcp-server-memory", []),
}


def _strings(value: Any, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ConfigError(f"{what} must be an object of strings")
    return dict(value)


def _catalog(name: str, settings: dict[str, Any]) -> ServerSpec:
    program, args = CATALOG[name]
    if name == "filesystem":
        paths = settings.get("paths", DEFAULT_PATHS)
        if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
            raise ConfigError("server 'filesystem': `paths` must be a non-empty list of paths")
        args = [*args, *paths]
    if name == "fetch":  # a KeepState setting (E2B's catalog has none): pages on private addresses, e.g. an intranet
        allow = settings.get("allowPrivateIps", settings.get("allow_private_ips", False))
        if not isinstance(allow, bool):
            raise ConfigError("server 'fetch': `allowPrivateIps` must be true or false")
        args = [*args, "--allow-private-ips"] if allow else args
    return ServerSpec(name, program, list(args), _strings(settings.get("envs"), f"server '{name}': `envs`"))


def _github(name: str, owner: str, repo: str, settings: dict[str, Any]) -> ServerSpec:
    run = settings.get("runCmd", settings.get("run_cmd"))
    install = settings.get("installCmd", settings.get("install_cmd"))
    if not isinstance(run, str) or not run.strip():
        raise ConfigError(f"server '{name}': `runCmd` (the command that starts a stdio MCP server) is required")
    if install is not None and not isinstance(install, str):
        raise ConfigError(f"server '{name}': `installCmd` must be a string")
    cwd = f"{GITHUB_ROOT}/github/{owner}/{repo}"
    return ServerSpec(name, "/bin/sh", ["-c", run], _strings(settings.get("envs"), f"server '{name}': `envs`"),
                      cwd=cwd, clone=f"https://github.com/{owner}/{repo}", install=install or None)


def parse(config: Any) -> list[ServerSpec]:
    """The servers `config` names, in its order; ConfigError for anything this gateway cannot run."""
    if not isinstance(config, dict):
        raise ConfigError("the config must be a JSON object of servers, e.g. {\"time\": {}}")
    if not config:
        raise ConfigError("the config names no server")
    if len(config) > MAX_SERVERS:
        raise ConfigError(f"the config names {len(config)} servers; at most {MAX_SERVERS}")
    specs = []
    for name, settings in config.items():
        if not isinstance(settings, dict):
            raise ConfigError(f"server '{name}': its settings must be an object (e.g. {{}})")
        if name in CATALOG:
            specs.append(_catalog(name, settings))
        elif (m := _GITHUB.match(name)) is not None:
            specs.append(_github(name, m.group(1), m.group(2), settings))
        elif name.startswith("github/"):
            raise ConfigError(f"server '{name}': a GitHub server's key is github/<owner>/<repo>")
        else:
            known = ", ".join(sorted(CATALOG))
            raise ConfigError(f"unknown MCP server '{name}': this gateway runs {known}, and github/<owner>/<repo> "
                              "servers with a runCmd")
    return specs


def missing(specs: list[ServerSpec]) -> list[str]:
    """The servers whose program is not installed here."""
    return [s.name for s in specs if shutil.which(s.program) is None]
