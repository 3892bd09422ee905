"""Manifests (what a checkpoint is made of and what a restore needs to refuse safely) and the refs that publish them."""

from __future__ import annotations

import datetime as dt
import json
import posixpath
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import zstandard

from keepstate.store import ids
from keepstate.store.errors import CorruptObject, IncompatibleCheckpoint

MAGIC = b"KSMF"
VERSION = 1
_HEAD = struct.Struct("<4sBBxx")
_FILE = struct.Struct("<BIQI")
_RUN = struct.Struct("<32sII")
KINDS = ("memory", "file")
REF_MAGIC = "keepstate-ref"


@dataclass(frozen=True)
class ImageFile:
    """One file of a checkpoint image handed to write_checkpoint. `name` is its relative path in the checkpoint;
    `kind` (one of KINDS) is how it is chunked: "memory" in fixed blocks, "file" content-defined."""

    name: str
    path: Path
    kind: str = "file"


@dataclass(frozen=True)
class EventRef:
    """The causal-history event a checkpoint was taken at."""

    seq: int
    hash: str


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class CheckpointMeta:
    session_id: str
    checkpoint_id: str = field(default_factory=ids.new_checkpoint_id)
    parent_id: str | None = None
    template_id: str = ""
    template_digest: str = ""
    runsc_release: str = ""
    cpu_features: tuple[str, ...] = ()
    sizes: dict[str, int] = field(default_factory=dict)
    event: EventRef | None = None
    created: str = field(default_factory=_now)
    labels: dict[str, str] = field(default_factory=dict)
    # Filled in by the store when the checkpoint is written.
    stats: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ids.check_checkpoint_id(self.checkpoint_id)
        if self.parent_id is not None:
            ids.check_checkpoint_id(self.parent_id)
        object.__setattr__(self, "cpu_features", tuple(self.cpu_features))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["cpu_features"] = list(self.cpu_features)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckpointMeta:
        event = data.get("event")
        return cls(
            session_id=str(data["session_id"]),
            checkpoint_id=str(data["checkpoint_id"]),
            parent_id=data.get("parent_id"),
            template_id=str(data.get("template_id", "")),
            template_digest=str(data.get("template_digest", "")),
            runsc_release=str(data.get("runsc_release", "")),
            cpu_features=tuple(data.get("cpu_features", ())),
            sizes={str(k): int(v) for k, v in data.get("sizes", {}).items()},
            event=EventRef(int(event["seq"]), str(event["hash"])) if event else None,
            created=str(data.get("created", "")),
            labels={str(k): str(v) for k, v in data.get("labels", {}).items()},
            stats={str(k): int(v) for k, v in data.get("stats", {}).items()},
        )


@dataclass(frozen=True)
class Run:
    """`repeat` consecutive occurrences of one chunk in a file."""

    chunk_id: bytes
    raw_len: int
    repeat: int = 1


@dataclass(frozen=True)
class FileEntry:
    name: str
    kind: str
    mode: int
    size: int
    runs: tuple[Run, ...]

    def chunk_offsets(self) -> Iterator[tuple[int, Run]]:
        """(offset in the file, run) for every run."""
        offset = 0
        for run in self.runs:
            yield offset, run
            offset += run.raw_len * run.repeat

    @property
    def chunk_count(self) -> int:
        return sum(r.repeat for r in self.runs)


@dataclass(frozen=True)
class Manifest:
    id: str  # storage ID (hex BLAKE3 of the stored bytes)
    meta: CheckpointMeta
    files: tuple[FileEntry, ...]

    @property
    def checkpoint_id(self) -> str:
        return self.meta.checkpoint_id

    @property
    def parent_id(self) -> str | None:
        return self.meta.parent_id

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def chunk_ids(self) -> set[bytes]:
        return {run.chunk_id for f in self.files for run in f.runs}

    def to_json(self) -> dict[str, Any]:
        """A summary for `--json` output and the API (chunk lists left out)."""
        return {
            "manifest_id": self.id,
            **self.meta.to_json(),
            "size": self.size,
            "files": [{"name": f.name, "kind": f.kind, "mode": f.mode, "size": f.size, "chunks": f.chunk_count}
                      for f in self.files],
        }


def check_file_name(name: str) -> str:
    norm = posixpath.normpath(name)
    if not name or name.startswith("/") or norm != name or norm.split("/")[0] == ".." or "\0" in name:
        raise ValueError(f"invalid image file name {name!r}: use a normalised relative path")
    return name


def to_bytes(meta: CheckpointMeta, files: list[FileEntry] | tuple[FileEntry, ...], level: int = 3) -> bytes:
    """The stored bytes of a manifest; its storage ID is their BLAKE3."""
    meta_json = json.dumps(meta.to_json(), sort_keys=True, separators=(",", ":")).encode()
    parts = [struct.pack("<I", len(meta_json)), meta_json, struct.pack("<I", len(files))]
    seen: set[str] = set()
    for f in files:
        check_file_name(f.name)
        if f.name in seen:
            raise ValueError(f"duplicate image file name {f.name!r}")
        seen.add(f.name)
        name = f.name.encode()
        parts += [struct.pack("<H", len(name)), name,
                  _FILE.pack(KINDS.index(f.kind), f.mode, f.size, len(f.runs))]
        parts += [_RUN.pack(r.chunk_id, r.raw_len, r.repeat) for r in f.runs]
    body = zstandard.ZstdCompressor(level=level).compress(b"".join(parts))
    return _HEAD.pack(MAGIC, VERSION, 1) + body


def decode(name: str, data: bytes) -> Manifest:
    """Verify a manifest's bytes against its storage ID `name` and parse them."""
    if ids.hexdigest(data) != name:
        raise CorruptObject("manifest", name, "content does not match its storage ID (BLAKE3)")
    try:
        magic, version, compression = _HEAD.unpack_from(data, 0)
        if magic != MAGIC:
            raise ValueError("not a manifest (bad magic)")
        if version != VERSION:
            raise ValueError(f"unsupported manifest version {version}")
        if compression != 1:
            raise ValueError(f"unknown body compression {compression}")
        body = zstandard.ZstdDecompressor().decompressobj().decompress(data[_HEAD.size:])
        (meta_len,) = struct.unpack_from("<I", body, 0)
        at = 4 + meta_len
        meta = CheckpointMeta.from_json(json.loads(body[4:at]))
        (count,) = struct.unpack_from("<I", body, at)
        at += 4
        files = []
        for _ in range(count):
            (name_len,) = struct.unpack_from("<H", body, at)
            at += 2
            fname = body[at:at + name_len].decode()
            at += name_len
            kind, mode, size, nruns = _FILE.unpack_from(body, at)
            at += _FILE.size
            runs = []
            for _ in range(nruns):
                chunk_id, raw_len, repeat = _RUN.unpack_from(body, at)
                at += _RUN.size
                runs.append(Run(bytes(chunk_id), raw_len, repeat))
            if sum(r.raw_len * r.repeat for r in runs) != size:
                raise ValueError(f"chunks of {fname!r} do not add up to its size {size}")
            files.append(FileEntry(check_file_name(fname), KINDS[kind], mode, size, tuple(runs)))
        if at != len(body):
            raise ValueError(f"{len(body) - at} trailing bytes in the body")
        return Manifest(name, meta, tuple(files))
    except (ValueError, KeyError, IndexError, TypeError, struct.error, zstandard.ZstdError) as exc:
        raise CorruptObject("manifest", name, str(exc)) from exc


def with_stats(meta: CheckpointMeta, stats: dict[str, int]) -> CheckpointMeta:
    return replace(meta, stats=dict(stats))


def encode_ref(checkpoint_id: str, manifest_id: str) -> bytes:
    line = f"{REF_MAGIC} {VERSION} {checkpoint_id} {manifest_id}"
    return f"{line}\n{ids.hexdigest(line.encode())}\n".encode()


def decode_ref(checkpoint_id: str, data: bytes) -> str:
    """Return the manifest ID a ref names, after checking the ref's checksum line."""
    try:
        line, check, rest = data.decode("ascii").split("\n")
        if rest or ids.hexdigest(line.encode()) != check:
            raise ValueError("checksum line does not match")
        magic, version, ref_id, manifest_id = line.split(" ")
        if magic != REF_MAGIC or version != str(VERSION):
            raise ValueError(f"unknown ref format {magic} {version}")
        if ref_id != checkpoint_id:
            raise ValueError(f"names checkpoint {ref_id}, not {checkpoint_id}")
        if not ids.is_hex_id(manifest_id):
            raise ValueError("bad manifest ID")
        return manifest_id
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptObject("ref", checkpoint_id, str(exc)) from exc


@dataclass(frozen=True)
class HostFacts:
    """What the restoring host offers; compared with the manifest by `check_restorable`."""

    runsc_release: str
    template_digest: str
    cpu_features: frozenset[str] | set[str] | tuple[str, ...] = ()


def restore_problems(manifest: Manifest, host: HostFacts) -> list[str]:
    meta = manifest.meta
    problems = []
    if meta.runsc_release and meta.runsc_release != host.runsc_release:
        problems.append(f"it was taken by runsc release {meta.runsc_release}, this host runs {host.runsc_release}")
    if meta.template_digest and meta.template_digest != host.template_digest:
        problems.append(f"its template digest is {meta.template_digest}, this host has {host.template_digest}")
    missing = sorted(set(meta.cpu_features) - set(host.cpu_features))
    if missing:
        problems.append(f"this host's CPU lacks {', '.join(missing)}")
    return problems


def check_restorable(manifest: Manifest, host: HostFacts) -> None:
    """Raise IncompatibleCheckpoint when the host cannot safely run the checkpoint's image."""
    problems = restore_problems(manifest, host)
    if problems:
        raise IncompatibleCheckpoint(manifest.checkpoint_id, problems)
