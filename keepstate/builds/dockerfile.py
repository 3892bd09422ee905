"""A Dockerfile, turned into a template build's steps (docs/design/template-builds.md, "Dockerfiles").

Pure parsing plus the build context's packing: the CLI (`keepstate template build --dockerfile`) sends what this
returns through the same protocol as the SDK, so a Dockerfile build and a `Template()` build share one builder.
Single-stage only: a second FROM, or `COPY --from`, is refused naming its line.
"""

from __future__ import annotations

import glob
import io
import json
import os
import shlex
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from keepstate.errors import BadRequest

from .steps import BASE_IMAGE, archive_hash

IGNORED = {"ARG", "EXPOSE", "LABEL", "MAINTAINER", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "VOLUME", "ONBUILD"}
DEFAULT_READY = "sleep 20"  # E2B's from_dockerfile: wait_for_timeout(20_000) after a CMD/ENTRYPOINT


@dataclass
class Parsed:
    base: str  # "e2bdev/base", a template name, or an image reference
    steps: list[dict[str, object]] = field(default_factory=list)  # the wire steps, COPY without filesHash yet
    start_cmd: str | None = None

    def body(self, ready_cmd: str | None, force: bool, is_template: bool) -> dict[str, object]:
        """The build's start body; `is_template`: the server knows `base` as a template (else it is an image)."""
        out: dict[str, object] = {"steps": self.steps, "force": force}
        if is_template and self.base != BASE_IMAGE:
            out["fromTemplate"] = self.base
        else:
            out["fromImage"] = self.base
        if self.start_cmd:
            out["startCmd"] = self.start_cmd
            out["readyCmd"] = ready_cmd or DEFAULT_READY
        elif ready_cmd:
            out["readyCmd"] = ready_cmd
        return out


def _lines(text: str) -> list[tuple[int, str]]:
    """Logical lines (continuations joined), without comments and blanks, with their first line number."""
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        out.append((start, (buf + line).strip()))
        buf = ""
    if buf:
        out.append((start, buf.strip()))
    return out


def _exec_form(rest: str) -> list[str] | None:
    if rest.startswith("["):
        try:
            words = json.loads(rest)
        except ValueError:
            return None
        if isinstance(words, list) and all(isinstance(w, str) for w in words):
            return words
    return None


def _command(rest: str) -> tuple[str, bool]:
    """(command, exec form?)"""
    words = _exec_form(rest)
    return (shlex.join(words), True) if words is not None else (rest, False)


def _flags(words: list[str], line: int, allowed: set[str]) -> tuple[dict[str, str], list[str]]:
    flags: dict[str, str] = {}
    while words and words[0].startswith("--"):
        key, _, value = words.pop(0)[2:].partition("=")
        if key == "from":
            raise BadRequest(f"line {line}: COPY --from is a multi-stage build, which keepstate does not support")
        if key not in allowed:
            raise BadRequest(f"line {line}: flag --{key} is not supported here")
        flags[key] = value
    return flags, words


def parse(text: str) -> Parsed:
    parsed: Parsed | None = None
    cmd: tuple[str, bool] | None = None
    entrypoint: tuple[str, bool] | None = None
    env: dict[str, str] = {}
    for line, logical in _lines(text):
        word, _, rest = logical.partition(" ")
        kind, rest = word.upper(), rest.strip()
        if kind == "FROM":
            if parsed is not None:
                raise BadRequest(f"line {line}: a second FROM: multi-stage builds are not supported (keep one "
                                 "stage, or build the first stage as a template and FROM it)")
            words = [w for w in rest.split() if not w.startswith("--platform")]
            if not words:
                raise BadRequest(f"line {line}: FROM needs an image or template")
            parsed = Parsed(base=words[0])
            continue
        if parsed is None:
            if kind == "ARG":
                continue
            raise BadRequest(f"line {line}: {kind} before FROM")
        if kind == "RUN":
            command, _ = _command(rest)
            parsed.steps.append({"type": "RUN", "args": [command], "force": False})
        elif kind in ("COPY", "ADD"):
            words = _exec_form(rest) or shlex.split(rest)
            flags, words = _flags(words, line, {"chown", "chmod"})
            if len(words) < 2:
                raise BadRequest(f"line {line}: {kind} needs a source and a destination")
            *srcs, dest = words
            for src in srcs:
                if "://" in src:
                    raise BadRequest(f"line {line}: ADD of a URL is not supported: download it in a RUN step")
                parsed.steps.append({"type": "COPY", "args": [src, dest, flags.get("chown", ""),
                                                              flags.get("chmod", "")], "force": False})
        elif kind == "ENV":
            pairs: list[str] = []
            words = shlex.split(rest)
            if words and "=" not in words[0]:
                pairs = [words[0], " ".join(words[1:])]
            else:
                for w in words:
                    k, sep, v = w.partition("=")
                    if not sep:
                        raise BadRequest(f"line {line}: ENV {w!r} is not name=value")
                    pairs += [k, v]
            for k, v in zip(pairs[::2], pairs[1::2], strict=True):
                env[k] = v
            parsed.steps.append({"type": "ENV", "args": pairs, "force": False})
        elif kind in ("WORKDIR", "USER"):
            if not rest:
                raise BadRequest(f"line {line}: {kind} needs a value")
            parsed.steps.append({"type": kind, "args": [rest], "force": False})
        elif kind == "CMD":
            cmd = _command(rest)
        elif kind == "ENTRYPOINT":
            entrypoint = _command(rest)
        elif kind in IGNORED:
            continue
        else:
            raise BadRequest(f"line {line}: {kind} is not supported in a template's Dockerfile")
    if parsed is None:
        raise BadRequest("the Dockerfile has no FROM")
    if entrypoint is not None:  # Docker's rules: an exec-form ENTRYPOINT takes CMD as arguments
        parsed.start_cmd = entrypoint[0]
        if entrypoint[1] and cmd is not None:
            parsed.start_cmd += " " + (cmd[0] if cmd[1] else shlex.join(["/bin/sh", "-c", cmd[0]]))
    elif cmd is not None:
        parsed.start_cmd = cmd[0]
    return parsed


def context_files(context: Path, src: str) -> list[Path]:
    """What a COPY of `src` sends: the matching paths and, under a matched directory, everything in it."""
    matches = sorted(glob.glob(src, root_dir=context)) if any(c in src for c in "*?[") else \
        [src] if os.path.lexists(context / src) else []
    if not matches:
        raise BadRequest(f"COPY {src}: nothing in the context {context} matches")
    out: list[Path] = []
    for m in matches:
        p = context / m
        out.append(p)
        if p.is_dir() and not p.is_symlink():
            for root, dirs, files in os.walk(p):
                dirs.sort()
                for name in sorted(dirs + files):
                    out.append(Path(root) / name)
    return out


def pack(context: Path, src: str, dest: str) -> tuple[bytes, str]:
    """A COPY step's upload (a gzip tar, links kept, paths relative to the context) and its filesHash."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in context_files(context, src):
            tar.add(p, arcname=os.path.relpath(p, context), recursive=False)
    data = buf.getvalue()
    return data, archive_hash(src, dest, io.BytesIO(data))
