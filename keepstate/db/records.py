"""The plain records the repositories (keepstate.db.repos) take and return: one per table row, no behaviour.

The domain packages convert them to their own types (`SandboxRow`, `Settings`, `ApiKey`, ...); this module imports
none of them. Frozen dataclasses (msgspec, which the design names, is not a dependency of the project), keyword-only
so that a record of seventeen fields cannot be built with two of them swapped. A field has the name of its column.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class KeyRecord:
    """An API key, without its hash: the hash is what `Keys.find` is asked for, never what it hands out."""

    id: str
    name: str
    prefix: str
    created_at: float
    revoked_at: float | None = None
    max_sandboxes: int | None = None  # running sandboxes at once (0: unlimited); None: the server's default


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxRecord:
    """A row of `sandboxes`. `doc` is the domain's typed settings as JSON text, stored and returned as it is."""

    sandbox_id: str
    state: str
    template_id: str
    template_digest: str
    runtime_name: str
    slot: int
    address: str
    access_token: str
    started_at: float
    end_at: float
    cpu: float
    memory_mb: int
    api_key_id: str | None
    doc: str
    node_id: str  # the node whose server owns the row ("local" on one host)
    epoch: int = 0  # the fencing token: moves when the row is handed to another owner (issue 27)
    version: int = 0  # moves on every write; every write is conditioned on it
    # When it was paused, by the database's clock (None: not paused); kept by the repository, not by its writers.
    paused_at: float | None = field(default=None, compare=False)
    # Handed to this row's node by a node that stopped (`--on-stop handover`): to resume there at once.
    resume_pending: bool = field(default=False, compare=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class LeaseRecord:
    """A named lease (`leases`): who holds it ('' once released), the token its latest acquisition got (it moves at
    every acquisition: a fencing token) and when it expires by the database's clock."""

    name: str
    holder: str
    token: int
    expires_at: float


@dataclass(frozen=True, kw_only=True, slots=True)
class TeardownRecord:
    """A teardown not yet finished (docs/design/teardown.md): the instance, its slot (-1: not ours to release), the
    failed attempts, when the next is due (0: at once) and what the last one said. `created_at` is set by the
    repository when the teardown is recorded; the value given is not written."""

    runtime_name: str
    slot: int
    attempts: int = 0
    next_try: float = 0.0
    last_error: str = ""
    created_at: float = 0.0
    node_id: str = "local"  # the node whose host holds the instance


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeRecord:
    """A node of the cluster (docs/design/cluster.md): one row per node name; `incarnation` moves at each join, and
    only the incarnation that holds the row may renew its lease. Times are the database's clock."""

    node_id: str
    address: str  # the URL other nodes reach it on
    cpus: float
    memory_mb: int
    max_sandboxes: int
    runsc_release: str
    cpu_features: tuple[str, ...] = ()
    templates: tuple[str, ...] = ()  # kept warm
    incarnation: int = 0
    state: str = "alive"  # alive | draining | dead | left | removed (a tombstone: incarnations never repeat)
    metrics: str = "{}"  # JSON, sent with each renewal
    joined_at: float = 0.0
    lease_expires_at: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeLoad:
    """A live node as placement sees it: its record and what its sandboxes hold (rows of holding states)."""

    node: NodeRecord
    sandboxes: int
    cpu: float
    memory_mb: int


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotRecord:
    """A snapshot (a checkpoint usable as a templateID) and its names, sorted; a name belongs to one snapshot."""

    snapshot_id: str
    checkpoint_id: str
    sandbox_id: str
    template_id: str
    created_at: float
    names: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class VolumeRecord:
    volume_id: str
    name: str
    token: str
    size_mb: int
    created_at: float


@dataclass(frozen=True, kw_only=True, slots=True)
class SecretRecord:
    """A secret without its value (the database holds only ciphertext, per version). `seq` orders the list and is
    its paging cursor; the database assigns it (the value given to `Secrets.put` is not written)."""

    secret_id: str
    name: str
    current_version: int
    metadata: dict[str, str] = field(default_factory=dict)
    created_at: float
    updated_at: float
    seq: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class EventRecord:
    """A row of `events`: one event of a session's hash chain, as stored. `data` is the text that was hashed (the
    canonical JSON of the event's data): stored and returned byte for byte, never parsed here."""

    session_id: str
    seq: int
    ts: float
    kind: str
    data: str
    prev: str
    hash: str


@dataclass(frozen=True, kw_only=True, slots=True)
class HeadRecord:
    """Where a session's chain ends: the seq and hash of its last event (seq 0: no event yet, the row holding only a
    journal cursor), and the journal cursor (None: never set)."""

    session_id: str
    seq: int
    hash: str
    journal_cursor: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionRecord:
    """A row of `sessions`: a session of the lineage (a fork names its parent session and checkpoint)."""

    session_id: str
    template_id: str | None
    created: float
    parent_session: str | None = None
    parent_checkpoint_id: str | None = None
    state: str


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointRecord:
    """A row of `checkpoints`: a published checkpoint of a session and the event it was taken at."""

    checkpoint_id: str
    session_id: str
    parent_checkpoint_id: str | None
    kind: str
    event_seq: int | None
    event_hash: str | None
    journal_cursor: int | None
    created: float


@dataclass(frozen=True, kw_only=True, slots=True)
class TemplateRecord:
    """A built template (docs/design/template-builds.md): what a create names, by ID or by its unique name."""

    template_id: str
    name: str
    cpu: int
    memory_mb: int
    created_at: float
    updated_at: float


@dataclass(frozen=True, kw_only=True, slots=True)
class BuildRecord:
    """One build of a template; `checkpoint_id` is its snapshot once `ready`. `reason` is stored as JSON text."""

    build_id: str
    template_id: str
    status: str  # waiting | building | ready | error
    created_at: float
    checkpoint_id: str | None = None
    sandbox_id: str | None = None
    reason: dict[str, Any] | None = None
    finished_at: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class TagRecord:
    """`(template, tag) -> build`: what `name:tag` resolves through."""

    template_id: str
    tag: str
    build_id: str
    created_at: float


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerRecord:
    """A step-cache layer: the checkpoint a cached build starts from, and the ENV/USER/WORKDIR state that comes with
    it (stored as JSON text). `created_at` is set by the repository when the layer is written."""

    cache_key: str
    checkpoint_id: str
    state: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class IdempotencyRecord:
    """An idempotent create's key (docs/design/idempotency.md): the request it was first used for (`digest`), the
    sandbox ID chosen for it, `in_progress` or `done` (with the answer), and the server incarnation running it."""

    api_key_id: str
    key: str
    digest: str
    sandbox_id: str
    state: str
    owner: str
    response: str | None = None
    created_at: float = 0.0
    expires_at: float = 0.0
