"""A template build's steps, as E2B's SDK sends them (docs/design/template-builds.md): parsed, checked and keyed.

Pure: no sandbox, no socket. The builder (service.py) runs what this module parses; the Dockerfile parser
(dockerfile.py) produces the same `Step`s, so both paths share one validation and one cache key.
"""

from __future__ import annotations

import hashlib
import json
import re
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from keepstate.errors import BadRequest

STEP_TYPES = ("COPY", "RUN", "ENV", "WORKDIR", "USER")
BASE_IMAGE = "e2bdev/base"  # what the SDK's from_base_image() names: our `base`
HASH_RE = re.compile(r"\A[0-9a-f]{64}\Z")
USER_RE = re.compile(r"\A[A-Za-z0-9_.][A-Za-z0-9_.-]*(:[A-Za-z0-9_.][A-Za-z0-9_.-]*)?\Z")
DEFAULT_READY_TIMEOUT = 120.0


@dataclass(frozen=True)
class Step:
    type: str
    args: tuple[str, ...]
    force: bool = False
    files_hash: str | None = None

    def describe(self) -> str:
        if self.type == "COPY":
            return f"COPY {self.args[0]} {self.args[1]}"
        return f"{self.type} {' '.join(self.args)}"


@dataclass
class BuildSpec:
    """A `POST /v2/templates/{id}/builds/{buildID}` body, checked."""

    steps: list[Step]
    from_template: str | None = None
    from_image: str | None = None
    registry: dict[str, Any] | None = None
    force: bool = False
    start_cmd: str | None = None
    ready_cmd: str | None = None

    @property
    def parent(self) -> str:
        """The template the build sandbox starts from (an OCI image's parent is the image itself)."""
        if self.from_template:
            return self.from_template
        return "base" if self.from_image in (None, BASE_IMAGE) else str(self.from_image)


@dataclass
class State:
    """What ENV, WORKDIR and USER leave for the later steps and for every sandbox of the template."""

    env: dict[str, str] = field(default_factory=dict)
    user: str = "user"
    workdir: str = "/home/user"

    def to_json(self) -> dict[str, Any]:
        return {"env": dict(self.env), "user": self.user, "workdir": self.workdir}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> State:
        return cls(env=dict(d.get("env") or {}), user=str(d.get("user") or "user"),
                   workdir=str(d.get("workdir") or "/home/user"))

    def apply(self, step: Step) -> None:
        if step.type == "ENV":
            for k, v in zip(step.args[::2], step.args[1::2], strict=True):
                self.env[k] = v
        elif step.type == "WORKDIR":
            self.workdir = step.args[0] if step.args[0].startswith("/") else \
                f"{self.workdir.rstrip('/')}/{step.args[0]}"
        elif step.type == "USER":
            self.user = step.args[0]


def _str(body: dict[str, Any], key: str) -> str | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, str) or not v.strip():
        raise BadRequest(f"`{key}` must be a non-empty string")
    return v


def parse_step(i: int, raw: Any) -> Step:
    """One step; `i` is its 1-based number, named in every error."""
    where = f"step {i}"
    if not isinstance(raw, dict):
        raise BadRequest(f"{where}: must be an object {{type, args, force?, filesHash?}}")
    kind = raw.get("type")
    if kind not in STEP_TYPES:
        raise BadRequest(f"{where}: `type` must be one of {', '.join(STEP_TYPES)} (got {kind!r})")
    args = raw.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise BadRequest(f"{where}: `args` must be a list of strings")
    force = raw.get("force") or False
    if not isinstance(force, bool):
        raise BadRequest(f"{where}: `force` must be a boolean")
    files_hash = raw.get("filesHash")
    if kind == "COPY":
        if len(args) < 2 or not args[0] or not args[1]:
            raise BadRequest(f"{where}: COPY needs args [src, dest, user?, mode?]")
        args = (args + ["", ""])[:4]
        if args[2] and not USER_RE.match(args[2]):
            raise BadRequest(f"{where}: COPY user {args[2]!r} is not a user name (or user:group)")
        if args[3] and not re.fullmatch(r"[0-7]{3,4}", args[3]):
            raise BadRequest(f"{where}: COPY mode {args[3]!r} is not an octal mode like 0755")
        if not isinstance(files_hash, str) or not HASH_RE.match(files_hash):
            raise BadRequest(f"{where}: COPY needs `filesHash` (64 hex digits)")
        if args[0].startswith("/") or ".." in Path(args[0]).parts:
            raise BadRequest(f"{where}: COPY source {args[0]!r} must be relative to the context, inside it")
    elif files_hash is not None:
        raise BadRequest(f"{where}: only COPY carries `filesHash`")
    if kind == "RUN" and (not 1 <= len(args) <= 2 or not args[0].strip()):
        raise BadRequest(f"{where}: RUN needs args [command, user?]")
    if kind == "RUN" and len(args) == 2 and args[1] and not USER_RE.match(args[1]):
        raise BadRequest(f"{where}: RUN user {args[1]!r} is not a user name")
    if kind == "ENV" and (not args or len(args) % 2 or not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)
                                                                 for k in args[::2])):
        raise BadRequest(f"{where}: ENV needs args [name1, value1, name2, value2, ...] with valid names")
    if kind in ("WORKDIR", "USER") and (len(args) != 1 or not args[0].strip()):
        raise BadRequest(f"{where}: {kind} needs exactly one argument")
    if kind == "USER" and not USER_RE.match(args[0]):
        raise BadRequest(f"{where}: USER {args[0]!r} is not a user name")
    return Step(kind, tuple(args), force, files_hash if kind == "COPY" else None)


def parse_spec(body: Any) -> BuildSpec:
    if not isinstance(body, dict):
        raise BadRequest("the build body must be a JSON object")
    steps = body.get("steps") or []
    if not isinstance(steps, list):
        raise BadRequest("`steps` must be a list")
    from_template, from_image = _str(body, "fromTemplate"), _str(body, "fromImage")
    if from_template and from_image:
        raise BadRequest("give `fromTemplate` or `fromImage`, not both")
    registry = body.get("fromImageRegistry")
    if registry is not None and not isinstance(registry, dict):
        raise BadRequest("`fromImageRegistry` must be an object")
    force = body.get("force") or False
    if not isinstance(force, bool):
        raise BadRequest("`force` must be a boolean")
    ready = _str(body, "readyCmd")
    return BuildSpec(steps=[parse_step(i + 1, s) for i, s in enumerate(steps)], from_template=from_template,
                     from_image=from_image, registry=registry, force=force, start_cmd=_str(body, "startCmd"),
                     ready_cmd=ready)


def parent_key(identity: str) -> str:
    return hashlib.sha256(f"parent\0{identity}".encode()).hexdigest()


def step_key(previous: str, step: Step) -> str:
    """The cache key after `step`: (parent, step, files hash), chained."""
    doc = json.dumps([previous, step.type, list(step.args), step.files_hash or ""], separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()


def chain(parent: str, steps: list[Step]) -> list[str]:
    """keys[i] is the key after steps[:i+1]."""
    keys, key = [], parent
    for s in steps:
        key = step_key(key, s)
        keys.append(key)
    return keys


def is_gzip(head: bytes) -> bool:
    return head[:2] == b"\x1f\x8b"


def has_directories(archive: IO[bytes]) -> bool:
    """Whether the tar holds directory entries: e2b releases before 2.5x hashed a directory's on-disk size, which
    no tar records, so their hash of such an upload cannot be recomputed here."""
    with tarfile.open(fileobj=archive, mode="r:*") as tar:
        return any(m.isdir() for m in tar)


def archive_hash(src: str, dest: str, archive: IO[bytes]) -> str:
    """The SDK's `calculate_files_hash`, recomputed from the uploaded tar: the tar holds exactly the files it hashed,
    in the same order, with their modes, sizes, link targets and contents."""
    h = hashlib.sha256(f"COPY {src} {dest}".encode())
    with tarfile.open(fileobj=archive, mode="r:*") as tar:
        for m in tar:
            h.update(m.name.encode())
            kind = stat.S_IFDIR if m.isdir() else stat.S_IFLNK if m.issym() else stat.S_IFREG
            h.update(str(kind | m.mode).encode())
            if m.issym():
                h.update(str(len(m.linkname.encode())).encode())
                h.update(m.linkname.encode())
                continue
            if not m.isdir():
                h.update(str(m.size).encode())
            if m.isreg():
                f = tar.extractfile(m)
                assert f is not None
                while chunk := f.read(1 << 20):
                    h.update(chunk)
    return h.hexdigest()
