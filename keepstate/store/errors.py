"""Errors raised by the checkpoint store.

    StoreError
    ├── BackendError                 the storage itself failed (I/O, network, permissions)
    │   ├── ObjectNotFound           load/stat of an object that does not exist
    │   └── ShortRead                the object is shorter than the range asked for (truncated)
    ├── RepositoryError              no repository at the location, or one of an unknown format
    ├── RepositoryLocked             another process holds a conflicting lock
    ├── CheckpointNotFound           no ref for that checkpoint ID
    ├── CheckpointExists             a ref with that checkpoint ID already names another manifest
    ├── CorruptObject                a stored object failed verification (names kind and object)
    │   └── CorruptCheckpoint        ... while reading one checkpoint (also names the checkpoint)
    ├── ArchiveError                 an export file is truncated, damaged or of an unknown format
    └── IncompatibleCheckpoint       this host cannot run the image (runsc release, template, CPU)
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error the store raises."""


class BackendError(StoreError):
    pass


class ObjectNotFound(BackendError):
    def __init__(self, key: str, location: str = "") -> None:
        self.key = key
        where = f" in {location}" if location else ""
        super().__init__(f"object {key!r} not found{where}")


class ShortRead(BackendError):
    pass


class RepositoryError(StoreError):
    pass


class RepositoryLocked(StoreError):
    pass


class CheckpointNotFound(StoreError):
    def __init__(self, checkpoint_id: str) -> None:
        self.checkpoint_id = checkpoint_id
        super().__init__(f"checkpoint {checkpoint_id!r} not found")


class CheckpointExists(StoreError):
    pass


class CorruptObject(StoreError):
    """`kind` is one of: config, ref, manifest, index, pack, chunk."""

    def __init__(self, kind: str, name: str, reason: str) -> None:
        self.kind = kind
        self.name = name
        self.reason = reason
        super().__init__(f"{kind} {name}: {reason}")


class CorruptCheckpoint(CorruptObject):
    def __init__(self, checkpoint_id: str, kind: str, name: str, reason: str) -> None:
        self.checkpoint_id = checkpoint_id
        super().__init__(kind, name, reason)
        self.args = (f"checkpoint {checkpoint_id}: {kind} {name}: {reason}",)

    def __str__(self) -> str:
        return str(self.args[0])


class ArchiveError(StoreError):
    pass


class IncompatibleCheckpoint(StoreError):
    def __init__(self, checkpoint_id: str, problems: list[str]) -> None:
        self.checkpoint_id = checkpoint_id
        self.problems = problems
        super().__init__(f"checkpoint {checkpoint_id} cannot be restored here: " + "; ".join(problems))
