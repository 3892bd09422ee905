"""The checkpoint store: content-addressed, deduplicated, verified storage of checkpoint images.

The format is specified in docs/design/checkpoint-format.md; the nouns there (chunk, pack, index, manifest, ref,
checkpoint, lineage) are the module names here.

    repo = Repository.open(backend_from_url("file:///var/lib/keepstate/store"))
    manifest = repo.write_checkpoint([ImageFile("pages.img", path, "memory")], CheckpointMeta(session_id="s1"))
    repo.read_checkpoint(manifest.checkpoint_id, dest_dir)
"""

from keepstate.store.backend import Backend, ObjectInfo, backend_from_url
from keepstate.store.backend.local import LocalBackend
from keepstate.store.errors import (
    ArchiveError,
    BackendError,
    CheckpointExists,
    CheckpointNotFound,
    CorruptCheckpoint,
    CorruptObject,
    IncompatibleCheckpoint,
    ObjectNotFound,
    RepositoryError,
    RepositoryLocked,
    ShortRead,
    StoreError,
)
from keepstate.store.gc import GcAborted, GcReport
from keepstate.store.manifest import (
    CheckpointMeta,
    EventRef,
    FileEntry,
    HostFacts,
    ImageFile,
    Manifest,
    check_restorable,
    restore_problems,
)
from keepstate.store.repository import RepoConfig, Repository
from keepstate.store.verify import Problem, VerifyReport


def __getattr__(name: str) -> object:
    # boto3 takes ~0.3 s to import; only S3 users pay for it.
    if name == "S3Backend":
        from keepstate.store.backend.s3 import S3Backend

        return S3Backend
    raise AttributeError(name)


__all__ = [
    "ArchiveError", "Backend", "BackendError", "CheckpointExists", "CheckpointMeta", "CheckpointNotFound",
    "CorruptCheckpoint", "CorruptObject", "EventRef", "FileEntry", "GcAborted", "GcReport", "HostFacts",
    "ImageFile", "IncompatibleCheckpoint", "LocalBackend", "Manifest", "ObjectInfo", "ObjectNotFound", "Problem",
    "RepoConfig", "Repository", "RepositoryError", "RepositoryLocked", "S3Backend", "ShortRead", "StoreError",
    "VerifyReport", "backend_from_url", "check_restorable", "restore_problems",
]
