"""Template definitions: TOML files shipped in the package, `keepstate/template/definitions/`, or in the
folder $KEEPSTATE_TEMPLATES names instead (docs/design/templates.md).

A definition is pure data; its *definition digest* names the build it produces, so a
template is rebuilt exactly when its definition, its parent, the agent's pinned
dependencies or a copied file change. Where the files lie does not enter the digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keepstate.errors import BadRequest, NotFound
from keepstate.rootfs import agent_requirements, package_file

BUILDER_VERSION = 2  # 2: the mount points of the template view and of volumes are in every build


BUILTIN_DEFINITIONS = package_file("keepstate.template", "definitions")


def definitions_dir() -> Path:
    return Path(os.environ.get("KEEPSTATE_TEMPLATES") or BUILTIN_DEFINITIONS)


@dataclass(frozen=True)
class Service:
    name: str
    command: list[str]
    port: int | None = None
    user: str = "root"
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Defaults:
    user: str = "user"
    workdir: str = "/home/user"
    cpu: float = 2.0
    memory_mb: int = 512
    env: dict[str, str] = field(default_factory=dict)
    disk_mb: int = 0  # the sandbox's disk quota; 0: the server's (`keepstate serve --disk-mb`)


@dataclass(frozen=True)
class Definition:
    name: str
    description: str
    parent: str | None
    suite: str
    variant: str
    apt: list[str]
    pip: list[str]
    npm: list[str]
    run: list[str]
    files: dict[str, str]  # source, relative to the definition's folder -> path in the root filesystem
    defaults: Defaults
    services: list[Service]
    source: Path

    def canonical(self) -> dict[str, Any]:
        return {
            "name": self.name, "parent": self.parent, "suite": self.suite, "variant": self.variant,
            "apt": self.apt, "pip": self.pip, "npm": self.npm, "run": self.run, "files": self.files,
            # disk_mb only when set: a definition that names none keeps the digest it had before the field.
            "defaults": {k: v for k, v in self.defaults.__dict__.items() if k != "disk_mb" or v},
            "services": [s.__dict__ for s in self.services],
        }


def _list(data: dict[str, Any], key: str, path: Path) -> list[str]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"{path}: `{key}` must be a list of strings")
    return list(value)


def parse(path: Path) -> Definition:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise BadRequest(f"template definition {path}: {exc}") from exc
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{path}: `name` is required")
    root = data.get("root", {})
    d = data.get("defaults", {})
    defaults = Defaults(
        user=str(d.get("user", "user")), workdir=str(d.get("workdir", "/home/user")),
        cpu=float(d.get("cpu", 2)), memory_mb=int(d.get("memory_mb", 512)), disk_mb=int(d.get("disk_mb", 0)),
        env={str(k): str(v) for k, v in d.get("env", {}).items()},
    )
    services = [
        Service(name=str(s["name"]), command=[str(c) for c in s["command"]],
                port=int(s["port"]) if s.get("port") is not None else None, user=str(s.get("user", "root")),
                env={str(k): str(v) for k, v in s.get("env", {}).items()})
        for s in data.get("services", [])
    ]
    files = {str(k): str(v) for k, v in data.get("files", {}).items()}
    return Definition(
        name=name, description=str(data.get("description", "")), parent=data.get("from"),
        suite=str(root.get("suite", "bookworm")), variant=str(root.get("variant", "minbase")),
        apt=_list(data, "apt", path), pip=_list(data, "pip", path), npm=_list(data, "npm", path),
        run=_list(data, "run", path), files=files, defaults=defaults, services=services, source=path,
    )


def load_all() -> dict[str, Definition]:
    out: dict[str, Definition] = {}
    for path in sorted(definitions_dir().glob("*.toml")):
        d = parse(path)
        out[d.name] = d
    return out


def load(name: str) -> Definition:
    defs = load_all()
    if name not in defs:
        raise NotFound(f"template '{name}' not found; known templates: {', '.join(sorted(defs)) or 'none'}")
    return defs[name]


def definition_digest(d: Definition, parent_digest: str | None) -> str:
    """Hash of everything that decides what a build contains."""
    h = hashlib.sha256()
    h.update(json.dumps({"builder": BUILDER_VERSION, "def": d.canonical(), "parent": parent_digest},
                        sort_keys=True).encode())
    if d.parent is None and (pins := agent_requirements()):
        # The pins alone, one per line: comments may change without a rebuild.
        h.update("".join(f"{pin}\n" for pin in pins).encode())
    for src in sorted(d.files):
        p = d.source.parent / src
        h.update(src.encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


__all__ = ["agent_requirements", "package_file"]  # keepstate.rootfs's, long read from here
