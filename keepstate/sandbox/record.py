"""A sandbox's record: what the catalog persists and the manifest's `sandbox` label carries to other servers.

`SandboxRow` is the row; `Settings` is what the create request and the lifecycle decided (it was an untyped `doc`
dict before; `Settings.from_json` still reads those, camelCase and snake_case keys alike, so catalogs and
checkpoints written by earlier releases load). Pure data, no I/O.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from keepstate.db.records import TeardownRecord
from keepstate.egress.policy import Policy

from .state import State


@dataclass(frozen=True)
class Instance:
    """A runtime instance that is not (or no longer) the sandbox's running one: a standby, or one being retired."""

    name: str
    slot: int
    address: str = ""
    since: float = 0.0  # standby: when it was frozen
    mem: int = 0  # standby: the memory it holds, bytes

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Instance:
        return cls(name=str(d["name"]), slot=int(d["slot"]), address=str(d.get("address", "")),
                   since=float(d.get("since", 0.0)), mem=int(d.get("mem", 0)))


@dataclass
class Settings:
    """Everything about a sandbox beyond its runtime identity."""

    session_id: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    template_env: dict[str, str] = field(default_factory=dict)
    auto_pause: bool = False
    auto_pause_memory: bool = True  # false: a timeout's auto-pause is filesystem-only
    allow_internet_access: bool | None = None
    user: str = "user"
    workdir: str = "/home/user"
    gateway: bool = True  # our extension: false keeps the metering gateway's variables out
    gateway_token: str | None = None
    checkpoint_id: str | None = None  # its latest checkpoint (pause, snapshot or fork)
    forked_from: str | None = None
    disk_mb: int = 0  # the writable layer's disk quota; 0: in memory (sandboxes from before the disk)
    files_only: bool = False  # paused without memory: a resume cold-boots it with its files
    standby: Instance | None = None  # paused: the frozen instance kept for a quick thaw
    retired: Instance | None = None  # an instance stopped by a pause whose teardown has not finished
    # Volumes mounted: [{"name", "path", "volume_id"}] (docs/design/volumes.md); restores need the same mounts.
    volume_mounts: list[dict[str, str]] = field(default_factory=list)
    # The create-time network policy, `Policy.to_json()` (keepstate/egress/policy.py; {}: the default policy).
    network: dict[str, Any] = field(default_factory=dict)
    auto_resume: bool = False  # traffic to it while paused resumes it (E2B's lifecycle autoResume)
    traffic_token: str | None = None  # `allowPublicTraffic: false`: port traffic must carry it (api/inbound.py)
    starting_timeout: int = 0  # the create's timeout, seconds: what an auto-resume gives it (0: the default)
    checkpoint_every: int = 0  # our `checkpointEvery`: seconds between policy checkpoints (0: the server's policy)
    checkpoint_at: float = 0.0  # when its latest checkpoint was taken (0: never, or before this was kept)
    envd_unresponsive: bool = False  # its agent did not answer when it was paused (E2B's envdUnresponsiveAtPause)
    from_image: bool = False  # a pooled instance restored from its build's boot image (not a boot of its own)

    @property
    def policy(self) -> Policy:
        """The sandbox's network policy (a record from before policies: `allow_internet_access` alone)."""
        if self.network:
            return Policy.from_json(self.network)
        return Policy(allow_internet_access=self.allow_internet_access is not False)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("standby", "retired"):
            if out[key] is None:
                del out[key]
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Settings:
        def pick(*names: str, default: Any = None) -> Any:
            for n in names:
                if n in d:
                    return d[n]
            return default

        def instance(name: str) -> Instance | None:
            v = d.get(name)
            return Instance.from_json(v) if isinstance(v, dict) else None

        return cls(
            session_id=str(pick("session_id", "sessionId", default="")),
            metadata=dict(pick("metadata", default={}) or {}),
            env_vars=dict(pick("env_vars", "envVars", default={}) or {}),
            template_env=dict(pick("template_env", "templateEnv", default={}) or {}),
            auto_pause=bool(pick("auto_pause", "autoPause", default=False)),
            auto_pause_memory=bool(pick("auto_pause_memory", default=True)),
            allow_internet_access=pick("allow_internet_access", "allowInternetAccess"),
            user=str(pick("user", default="user")), workdir=str(pick("workdir", default="/home/user")),
            gateway=bool(pick("gateway", default=True)), gateway_token=pick("gateway_token", "gatewayToken"),
            checkpoint_id=pick("checkpoint_id", "checkpointId"), forked_from=pick("forked_from", "forkedFrom"),
            disk_mb=int(pick("disk_mb", default=0) or 0), files_only=bool(pick("files_only", default=False)),
            standby=instance("standby"), retired=instance("retired"),
            volume_mounts=[dict(m) for m in pick("volume_mounts", "volumeMounts", default=[]) or []],
            network=dict(pick("network", default={}) or {}),
            auto_resume=bool(pick("auto_resume", "autoResume", default=False)),
            traffic_token=pick("traffic_token", "trafficAccessToken"),
            starting_timeout=int(pick("starting_timeout", default=0) or 0),
            checkpoint_every=int(pick("checkpoint_every", default=0) or 0),
            checkpoint_at=float(pick("checkpoint_at", default=0.0) or 0.0),
            envd_unresponsive=bool(pick("envd_unresponsive", default=False)),
            from_image=bool(pick("from_image", default=False)),
        )


@dataclass
class SandboxRow:
    """One sandbox, in every state. `runtime_name`, `slot` and `address` name its running instance ("", -1, "" when
    it has none: paused)."""

    sandbox_id: str
    state: State
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
    api_key_id: str | None = None
    settings: Settings = field(default_factory=Settings)

    def __post_init__(self) -> None:
        self.state = State(self.state)

    @property
    def session_id(self) -> str:
        return self.settings.session_id or self.sandbox_id

    def instance(self) -> Instance:
        return Instance(self.runtime_name, self.slot, self.address)

    def with_instance(self, inst: Instance) -> SandboxRow:
        """A copy naming another instance (to tear down a standby or a retired instance through the same code)."""
        return replace(self, runtime_name=inst.name, slot=inst.slot, address=inst.address,
                       settings=replace(self.settings))

    def copy(self) -> SandboxRow:
        return replace(self, settings=replace(self.settings, metadata=dict(self.settings.metadata),
                                              env_vars=dict(self.settings.env_vars),
                                              network=dict(self.settings.network)))


def portable(row: SandboxRow) -> dict[str, Any]:
    """What another server needs to bring the sandbox back under the same ID (the manifest's `sandbox` label)."""
    settings = row.settings.to_json()
    settings.pop("standby", None)
    settings.pop("retired", None)
    return {"sandbox_id": row.sandbox_id, "template_id": row.template_id, "cpu": row.cpu,
            "memory_mb": row.memory_mb, "access_token": row.access_token, "api_key_id": row.api_key_id,
            "started_at": row.started_at, "doc": settings}


@dataclass(frozen=True)
class Snapshot:
    """What a create may start from besides a rootfs template: a snapshot of a sandbox, or a built template (or one
    of its cached layers: keepstate.builds resolves both to this). `pool`: a built template's name (and tag), whose
    warm pool of restores serves its creates (creates.py); None for a snapshot."""

    snapshot_id: str
    checkpoint_id: str
    sandbox_id: str  # the sandbox it was taken of ("template-build" for a layer)
    template_id: str
    names: tuple[str, ...]
    created_at: float = 0.0
    pool: str | None = None


__all__ = ["Instance", "SandboxRow", "Settings", "Snapshot", "TeardownRecord"]
