"""Checking stored objects: every ref, manifest, index object and pack (with every chunk in it), or one checkpoint's."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from keepstate.store import ids, pack
from keepstate.store.errors import BackendError, CheckpointNotFound, CorruptObject, ObjectNotFound
from keepstate.store.index import Index
from keepstate.store.manifest import Manifest
from keepstate.store.repository import CONFIG_KEY, RepoConfig

if TYPE_CHECKING:
    from keepstate.store.repository import Repository


@dataclass(frozen=True)
class Problem:
    """One object that failed verification. `kind`: config, ref, manifest, index, pack or chunk."""

    kind: str
    name: str
    message: str
    checkpoints: tuple[str, ...] = ()

    def __str__(self) -> str:
        affected = f" (affects checkpoint {', '.join(self.checkpoints)})" if self.checkpoints else ""
        return f"{self.kind} {self.name}: {self.message}{affected}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "message": self.message, "checkpoints": list(self.checkpoints)}


@dataclass
class VerifyReport:
    checkpoint_id: str | None = None
    checked: dict[str, int] = field(default_factory=dict)  # objects checked per kind
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # harmless findings, e.g. leftovers for gc

    @property
    def ok(self) -> bool:
        return not self.problems

    def count(self, kind: str, n: int = 1) -> None:
        self.checked[kind] = self.checked.get(kind, 0) + n

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "checkpoint_id": self.checkpoint_id, "checked": self.checked,
                "bytes_checked": self.bytes_checked, "problems": [p.to_json() for p in self.problems],
                "notes": self.notes}


def _check_pack(repo: Repository, pack_id: bytes, expected: Iterable[pack.PackEntry] | None,
                only: set[bytes] | None) -> tuple[int, list[tuple[str, str]]]:
    """Verify a whole pack: its storage ID, its structure, its chunks (all, or `only`), and that it agrees with
    what the index says. Returns (bytes read, [(kind, message)])."""
    name = pack_id.hex()
    try:
        data = repo.backend.load(repo.pack_key(pack_id))
    except ObjectNotFound:
        return 0, [("pack", "missing from the store but listed in the index")]
    except BackendError as exc:
        return 0, [("pack", f"cannot be read: {exc}")]
    problems: list[tuple[str, str]] = []
    if ids.digest(data) != pack_id:
        problems.append(("pack", "content does not match its storage ID (BLAKE3)"))
    try:
        entries = pack.parse(name, data)
    except CorruptObject as exc:
        return len(data), problems + [("pack", exc.reason)]
    view = memoryview(data)
    for entry in entries:
        if only is not None and entry.chunk_id not in only:
            continue
        try:
            pack.decode_chunk(entry, view[entry.offset:entry.offset + entry.stored_len])
        except ValueError as exc:
            problems.append(("pack", f"chunk {entry.chunk_id.hex()} at offset {entry.offset}: {exc}"))
    if expected is not None and set(expected) != set(entries):
        problems.append(("pack", "its entry table differs from the index's record of it"))
    return len(data), problems


def _users(manifests: dict[str, Manifest]) -> dict[bytes, list[str]]:
    users: dict[bytes, list[str]] = {}
    for checkpoint_id, m in manifests.items():
        for chunk_id in m.chunk_ids():
            users.setdefault(chunk_id, []).append(checkpoint_id)
    return users


def _check_packs(repo: Repository, report: VerifyReport, index: Index, pack_ids: Iterable[bytes],
                 users: dict[bytes, list[str]], only: set[bytes] | None) -> None:
    pack_ids = list(pack_ids)

    def one(pack_id: bytes) -> tuple[bytes, int, list[tuple[str, str]]]:
        record = index.packs.get(pack_id)
        read, problems = _check_pack(repo, pack_id, record.entries if record else None, only)
        return pack_id, read, problems

    with ThreadPoolExecutor(repo.workers, thread_name_prefix="ks-verify") as pool:
        for pack_id, read, problems in pool.map(one, pack_ids):
            report.count("pack")
            report.bytes_checked += read
            record = index.packs.get(pack_id)
            affected = sorted({c for e in (record.entries if record else ()) for c in users.get(e.chunk_id, ())})
            for kind, message in problems:
                report.problems.append(Problem(kind, pack_id.hex(), message, tuple(affected)))


def verify_repository(repo: Repository) -> VerifyReport:
    """Check every object in the repository (bypassing the local cache)."""
    report = VerifyReport()
    try:
        RepoConfig.from_bytes(repo.backend.load(CONFIG_KEY))
        report.count("config")
    except (CorruptObject, ObjectNotFound) as exc:
        report.problems.append(Problem("config", CONFIG_KEY, str(exc)))

    stored_manifests = {info.key.split("/", 1)[1] for info in repo.backend.list("manifests/")}
    manifests_by_id: dict[str, Manifest] = {}
    for name in sorted(stored_manifests):
        report.count("manifest")
        try:
            manifests_by_id[name] = repo.load_manifest(name, use_cache=False)
        except CorruptObject as exc:
            report.problems.append(Problem("manifest", name, exc.reason))
        except ObjectNotFound:
            continue

    live: dict[str, Manifest] = {}
    corrupt_manifests = {p.name for p in report.problems if p.kind == "manifest"}
    for checkpoint_id in repo.ref_ids():
        report.count("ref")
        try:
            manifest_id = repo.manifest_id_of(checkpoint_id)
        except CorruptObject as exc:
            report.problems.append(Problem("ref", checkpoint_id, exc.reason, (checkpoint_id,)))
            continue
        except CheckpointNotFound:
            continue
        if manifest_id in corrupt_manifests:
            report.problems = [Problem(p.kind, p.name, p.message, p.checkpoints + (checkpoint_id,))
                               if p.kind == "manifest" and p.name == manifest_id else p for p in report.problems]
        elif manifest_id not in manifests_by_id:
            report.problems.append(Problem("manifest", manifest_id, "missing from the store", (checkpoint_id,)))
        elif manifests_by_id[manifest_id].checkpoint_id != checkpoint_id:
            report.problems.append(Problem("ref", checkpoint_id, f"names manifest {manifest_id} of another "
                                           "checkpoint", (checkpoint_id,)))
        else:
            live[checkpoint_id] = manifests_by_id[manifest_id]
    unreferenced = len(stored_manifests) - len({m.id for m in live.values()}) - len(corrupt_manifests)
    if unreferenced > 0:
        report.notes.append(f"{unreferenced} manifest(s) no ref names (gc removes them)")

    index, bad = repo.load_index(use_cache=False)
    report.count("index", len(index.index_ids) + len(bad))
    for broken in bad:
        report.problems.append(Problem("index", broken.name, broken.reason))

    users = _users(live)
    for chunk_id, checkpoints in users.items():
        if chunk_id not in index:
            report.problems.append(Problem("chunk", chunk_id.hex(), "not found in any intact index",
                                           tuple(sorted(checkpoints))))

    stored_packs = {bytes.fromhex(info.key.rsplit("/", 1)[1]) for info in repo.backend.list("packs/")
                    if ids.is_hex_id(info.key.rsplit("/", 1)[1])}
    unindexed = stored_packs - set(index.packs)
    if unindexed:
        report.notes.append(f"{len(unindexed)} pack(s) no index lists (leftovers of interrupted writes; "
                            "gc removes them)")
    _check_packs(repo, report, index, sorted(stored_packs | set(index.packs)), users, None)
    return report


def verify_checkpoint(repo: Repository, checkpoint_id: str) -> VerifyReport:
    """Check everything restoring `checkpoint_id` would use: ref, manifest, index, and every pack it reads."""
    report = VerifyReport(checkpoint_id=checkpoint_id)
    try:
        manifest_id = repo.manifest_id_of(checkpoint_id)
        report.count("ref")
    except CorruptObject as exc:
        report.problems.append(Problem("ref", checkpoint_id, exc.reason, (checkpoint_id,)))
        return report
    try:
        manifest = repo.load_manifest(manifest_id, use_cache=False)
        report.count("manifest")
    except ObjectNotFound:
        report.problems.append(Problem("manifest", manifest_id, "missing from the store", (checkpoint_id,)))
        return report
    except CorruptObject as exc:
        report.problems.append(Problem("manifest", manifest_id, exc.reason, (checkpoint_id,)))
        return report
    index, bad = repo.load_index(use_cache=False)
    report.count("index", len(index.index_ids))
    needed = manifest.chunk_ids()
    missing = [c for c in needed if c not in index]
    for broken in bad:
        if missing:  # R4: a corrupt index matters to this checkpoint only if it could hold what we lack
            report.problems.append(Problem("index", broken.name, broken.reason, (checkpoint_id,)))
    for chunk_id in missing:
        report.problems.append(Problem("chunk", chunk_id.hex(), "not found in any intact index", (checkpoint_id,)))
    pack_ids = {loc.pack_id for c in needed if (loc := index.get(c)) is not None}
    _check_packs(repo, report, index, sorted(pack_ids), {c: [checkpoint_id] for c in needed}, needed)
    return report


def format_report(report: VerifyReport) -> str:
    scope = f"checkpoint {report.checkpoint_id}" if report.checkpoint_id else "store"
    checked = ", ".join(f"{n} {k}" for k, n in sorted(report.checked.items()))
    lines = [f"{scope}: checked {checked} ({report.bytes_checked} bytes of packs)"]
    lines += [f"  note: {n}" for n in report.notes]
    lines += [f"  PROBLEM {p}" for p in report.problems]
    lines.append("OK" if report.ok else f"{len(report.problems)} problem(s) found")
    return "\n".join(lines)


__all__ = ["Problem", "VerifyReport", "format_report", "verify_checkpoint", "verify_repository"]
