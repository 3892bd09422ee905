"""Creates: a new sandbox from a template build (claimed from its warm pool, else started) or from a snapshot.

Warm pools (pool.py) hold sandboxes started ahead of demand:
- one per template build (`base` and the TOML templates, keyed by the build's digest): booted, agent initialised,
  sent nothing until claimed;
- one per built template of the Template SDK (a snapshot of its ready build sandbox, keyed by its checkpoint):
  restored from that checkpoint with the start command already up, as a create would restore it. Such a pool is
  started by the template's first create, replaced when the template is rebuilt (a create that resolves to a new
  checkpoint), and drained after TEMPLATE_POOL_IDLE seconds without a create. Adoption after a restart reaps its
  sandboxes (adopt.py): the next create refills it.

A claim hands the pooled record to the create in one step under the sandbox places' reservation
(docs/design/admission.md): new identity where the pool could not know it (env vars, a policy), same instance.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from keepstate.errors import BadRequest, NotFound, Refused, Unavailable
from keepstate.runtime.base import Limits
from keepstate.store import Manifest
from keepstate.template.builder import Built

from .agent_client import agent_url
from .checkpoints import new_sandbox_id
from .pool import WarmPool
from .record import SandboxRow, Settings, Snapshot
from .state import Command, State, require
from .traffic import traffic_token

if TYPE_CHECKING:
    from .manager import SandboxManager

DEFAULT_TIMEOUT = 300
MAX_TIMEOUT = 24 * 3600  # E2B's Pro plan: `serve --max-timeout`'s default
NO_LIMIT = 100 * 365 * 24 * 3600  # with `--max-timeout 0`: still a time an end can be written as (RFC 3339)
TEMPLATE_POOL_IDLE = 900.0  # seconds without a create before a built template's pool is drained


@dataclass
class CreateRequest:
    template_id: str
    timeout: int = DEFAULT_TIMEOUT
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    auto_pause: bool = False
    cpu: float | None = None
    memory_mb: int | None = None
    disk_mb: int | None = None  # our extension (`diskSizeMB`)
    auto_pause_memory: bool = True  # false: a timeout's auto-pause keeps the files only
    allow_internet_access: bool | None = None
    gateway: bool = True  # our extension: false keeps the metering gateway's variables out
    volume_mounts: list[tuple[str, str]] = field(default_factory=list)  # (volume name, absolute path)
    network: dict[str, Any] = field(default_factory=dict)  # the create's policy, Policy.to_json() ({}: default)
    auto_resume: bool = False  # lifecycle autoResume: traffic to it while paused resumes it
    checkpoint_every: int = 0  # our `checkpointEvery` (seconds; 0: the server's checkpoint policy)
    sandbox_id: str | None = None  # chosen before the create by an idempotent one (docs/design/idempotency.md)


def check_timeout(value: Any, field_name: str = "timeout", limit: int = MAX_TIMEOUT) -> int:
    """A timeout in whole seconds (a fraction is truncated), at most `limit` (the server's `--max-timeout`; 0: none)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise BadRequest(f"`{field_name}` must be a whole number of seconds")
    bound = limit or NO_LIMIT
    if value > bound:
        raise BadRequest(timeout_too_long(bound))
    if value < -bound:
        raise BadRequest(f"`{field_name}` must be a whole number of seconds")
    return int(value)


def timeout_too_long(limit: int) -> str:
    """E2B's words for a timeout over the limit ("Timeout cannot be greater than 24 hours": SDKs match them)."""
    if limit % 3600 == 0:
        return f"Timeout cannot be greater than {limit // 3600} hour{'s' if limit != 3600 else ''}"
    return f"Timeout cannot be greater than {limit} seconds"


@dataclass
class SnapshotPool:
    """What a built template's pool restores from, and when a create last came for it."""

    pool: WarmPool
    manifest: Manifest
    parent: SandboxRow  # the template's build sandbox as its checkpoint recorded it
    last_used: float = field(default_factory=time.monotonic)


class Creates:
    def __init__(self, m: SandboxManager) -> None:
        self.m = m
        self._builds: dict[str, asyncio.Task[Built]] = {}
        self.snapshot_pools: dict[str, SnapshotPool] = {}  # by checkpoint ID; their Pools are in m.pools too

    # -- template builds and their pools --------------------------------------------------------------------------
    async def built(self, template: str) -> Built:
        """The template's latest build; a first use starts the build and asks the caller to retry."""
        m = self.m
        try:
            built = await asyncio.to_thread(m.templates.latest, template)
        except NotFound:
            raise NotFound(f"template '{template}' not found") from None
        if built is not None:
            return built
        task = self._builds.get(template)
        if task is None or task.done():
            self._builds[template] = asyncio.get_running_loop().create_task(
                asyncio.to_thread(m.templates.ensure_built, template))
        raise Unavailable(f"template '{template}' is being built for its first use (about a minute); "
                          f"retry then, or run `keepstate template build {template}` ahead of time")

    def pool(self, built: Built) -> WarmPool:
        """The warm pool of one template build (keyed by its digest: a rebuilt template gets a new pool)."""
        m = self.m
        pool = m.pools.get(built.digest)
        if pool is None:
            pool = m.pools[built.digest] = WarmPool(built.digest, m.pool_size, lambda: self._start_pooled(built.name),
                                                template=built.name, room=m.places.room)
        return pool

    async def _start_pooled(self, template: str) -> SandboxRow:
        """Start a sandbox for the pool and initialise its agent with a fresh token and the template's defaults,
        so that a create that brings no env vars of its own only has to claim it."""
        m = self.m
        built = await self.built(template)
        d = built.defaults
        row = await m.instances.start(built, self.limits(built), refill=True)
        row.access_token = secrets.token_hex(16)
        row.settings = Settings(template_env=dict(d.env), user=d.user, workdir=d.workdir,
                                from_image=row.settings.from_image)
        try:
            await m.instances.init_agent(row, dict(d.env))
        except BaseException:
            await m.instances.reap(row)
            raise
        await m.rows.put(row)
        return row

    def pooled(self, built: Built, limits: Limits) -> SandboxRow | None:
        """A warm sandbox of exactly this build and these limits, if its pool has one (a filesystem-only resume)
        booted on its own: one restored from the build's boot image shares that boot (its kernel's boot_id), and a
        filesystem-only resume is a new boot (E2B's SDK tests check it), so it boots anew instead."""
        pool = self.m.pools.get(built.digest)
        if pool is None or limits != self.limits(built) or any(r.settings.from_image for r in pool.ready()):
            return None
        return self.take(pool)

    def take(self, pool: WarmPool) -> SandboxRow | None:
        """A pooled sandbox, thawed if the idle freezer froze it (its ID changes now: the waker would not know it)."""
        row = pool.take()
        if row is not None:
            self.m.idle.wake(row.sandbox_id)
        return row

    def limits(self, built: Built, req: CreateRequest | None = None) -> Limits:
        """A new sandbox's limits: the request's, else its template's, else (the disk) the server's."""
        d = built.defaults
        ask = req or CreateRequest(template_id=built.name)
        return Limits(cpu=ask.cpu or d.cpu, memory_mb=ask.memory_mb or d.memory_mb,
                      disk_mb=ask.disk_mb or d.disk_mb or self.m.disk_mb)

    # -- create ---------------------------------------------------------------------------------------------------
    async def create(self, req: CreateRequest, api_key_id: str | None,
                     volume_mounts: list[dict[str, str]]) -> SandboxRow:
        m = self.m
        if req.timeout <= 0:
            raise BadRequest("`timeout` must be a positive number of seconds")
        snap = await m.find_snapshot(req.template_id)
        if snap is not None:
            return await self._from_snapshot(snap, req, api_key_id)
        built = await self.built(req.template_id)
        d = built.defaults
        limits = self.limits(built, req)
        pool = self.pool(built)
        pool.start()
        # A pooled sandbox has no volumes: a create with mounts starts a fresh instance with them.
        pooled = limits == self.limits(built) and not volume_mounts
        claim = pooled and len(pool) > 0
        # Its places are checked and reserved in this step, and handed to its record in the step that lists it
        # (docs/design/admission.md). A warm sandbox claimed is on the host already: no host place is checked.
        with m.places.reserve(api_key_id, check_host=not claim):
            row = self.take(pool) if claim else None
            if row is None:
                row = await m.instances.start(built, limits, await m.instances.mounts(volume_mounts))
            require(Command.CREATE, row.state, row.sandbox_id)
            old_id, ready_token = row.sandbox_id, row.access_token  # a pooled agent has a token; a cold one none
            now = time.time()
            row.sandbox_id = req.sandbox_id or new_sandbox_id()
            row.access_token = ready_token or secrets.token_hex(16)
            row.started_at, row.end_at = now, now + req.timeout
            row.api_key_id = api_key_id
            row.settings = Settings(session_id=row.sandbox_id, metadata=dict(req.metadata),
                                    env_vars=dict(req.env_vars), template_env=dict(d.env), auto_pause=req.auto_pause,
                                    auto_pause_memory=req.auto_pause_memory,
                                    allow_internet_access=req.allow_internet_access, user=d.user, workdir=d.workdir,
                                    gateway=req.gateway, disk_mb=limits.disk_mb, volume_mounts=volume_mounts,
                                    network=dict(req.network), auto_resume=req.auto_resume,
                                    traffic_token=traffic_token(req.network), starting_timeout=req.timeout,
                                    checkpoint_every=req.checkpoint_every)
            try:
                await m.instances.attach(row)
                env = await m.gateway.env(row)
                if not ready_token or env != dict(d.env):
                    # Something the pool could not know: this request's env vars, or its gateway token.
                    await m.instances.init_agent(row, env, previous_token=ready_token or None)
                await m.table.claim(row, lambda: m.rows.claim(old_id, row))
            except BaseException:
                await m.instances.reap(row, catalog_id=old_id)
                raise
            m.agents.started(row.sandbox_id)
        await m.recorder.created(row.sandbox_id, row.template_id, row.template_digest, req.metadata, req.timeout,
                                 agent_url=agent_url(row.address), token=row.access_token)
        return row

    async def _from_snapshot(self, snap: Snapshot, req: CreateRequest, api_key_id: str | None) -> SandboxRow:
        """A create from a snapshot or a built template: a restore of its checkpoint (claimed from the template's
        pool when it has one ready)."""
        m = self.m
        checkpoint_id = snap.checkpoint_id
        held = self.snapshot_pools.get(checkpoint_id) if snap.pool else None
        # A pooled restore has its ID already: an idempotent create, whose ID was chosen first, restores anew.
        if held is not None and not req.volume_mounts and req.sandbox_id is None:
            row = await self._claim(held, req, api_key_id)
            if row is not None:
                return row
        manifest = held.manifest if held is not None else await asyncio.to_thread(m.durable.manifest, checkpoint_id)
        parent = parent_row(manifest, snap, api_key_id)
        if snap.pool and held is None and not parent.settings.volume_mounts and m.template_pool_size > 0:
            self._snapshot_pool(snap, manifest, parent.copy()).pool.start()
        settings = parent.settings
        settings.metadata = dict(req.metadata)
        settings.env_vars = {**settings.env_vars, **req.env_vars}
        settings.auto_pause = req.auto_pause
        settings.auto_resume, settings.starting_timeout = req.auto_resume, req.timeout
        settings.checkpoint_every, settings.checkpoint_at = req.checkpoint_every, 0.0
        if req.network:  # the create's policy, else the snapshot's
            settings.network = dict(req.network)
        theirs = [(m_["name"], m_["path"]) for m_ in settings.volume_mounts]
        if req.volume_mounts and sorted(req.volume_mounts) != sorted(theirs):
            raise Refused(f"snapshot '{snap.snapshot_id}' was taken with volume mounts {theirs or 'none'}; a "
                          "sandbox made from it gets exactly those (gVisor restores only onto the same mounts)")
        with m.places.reserve(api_key_id):  # its record is listed in the step _spawn returns in
            result = (await m.spawn(manifest, parent, 1, req.timeout, api_key_id, sandbox_id=req.sandbox_id))[0]
        if result.row is None:
            assert result.error is not None
            raise result.error
        return result.row

    def _snapshot_pool(self, snap: Snapshot, manifest: Manifest, parent: SandboxRow) -> SnapshotPool:
        """A new pool for this checkpoint of a built template; the template's pools of earlier builds go."""
        m = self.m
        name = str(snap.pool)  # the template (and tag) it is of: what /health names it by
        for old_id, old in list(self.snapshot_pools.items()):
            if old.pool.template == name:
                self.drop_pool(old_id)
        pool = WarmPool(manifest.checkpoint_id, m.template_pool_size, lambda: self._restore_pooled(manifest, parent),
                    template=name, room=m.places.room)
        held = self.snapshot_pools[manifest.checkpoint_id] = SnapshotPool(pool, manifest, parent)
        m.pools[manifest.checkpoint_id] = pool
        return held

    async def _restore_pooled(self, manifest: Manifest, parent: SandboxRow) -> SandboxRow:
        """A sandbox restored from a built template's checkpoint for its pool: agent answering with a token of its
        own, its slot sending nothing until a create claims it."""
        m = self.m
        result = (await m.checkpoints.spawn(manifest, parent, 1, MAX_TIMEOUT, pooled=True))[0]
        if result.row is None:
            assert result.error is not None
            raise result.error
        return result.row

    async def _claim(self, held: SnapshotPool, req: CreateRequest, api_key_id: str | None) -> SandboxRow | None:
        m = self.m
        held.last_used = time.monotonic()
        held.pool.start()
        if not len(held.pool):
            return None
        with m.places.reserve(api_key_id, check_host=False):
            row = self.take(held.pool)
            if row is None:
                return None
            require(Command.CREATE, row.state, row.sandbox_id)
            s = row.settings
            now = time.time()
            row.started_at, row.end_at, row.api_key_id = now, now + req.timeout, api_key_id
            pool_env = await m.gateway.env(row)
            s.metadata = dict(req.metadata)
            s.env_vars = {**s.env_vars, **req.env_vars}
            s.auto_pause, s.auto_resume, s.starting_timeout = req.auto_pause, req.auto_resume, req.timeout
            s.checkpoint_every, s.checkpoint_at = req.checkpoint_every, 0.0
            if req.network:
                s.network = dict(req.network)
                s.traffic_token = traffic_token(req.network)
            try:
                await m.instances.attach(row)
                env = await m.gateway.env(row)
                if env != pool_env:  # this request's env vars: the agent hears them (and its identity again)
                    await m.instances.init_agent(row, env, previous_token=row.access_token, fork=True)
                await m.table.claim(row, lambda: m.rows.put(row))
            except BaseException:
                await m.instances.reap(row)
                raise
        await m.recorder.forked(held.parent.session_id, row.sandbox_id, held.manifest.checkpoint_id,
                                agent_url=agent_url(row.address), token=row.access_token)
        return row

    def drop_pool(self, checkpoint_id: str) -> None:
        """Retire a built template's pool: its filling stops and its sandboxes are torn down in the background."""
        m = self.m
        held = self.snapshot_pools.pop(checkpoint_id, None)
        m.pools.pop(checkpoint_id, None)
        if held is None:
            return

        async def retire() -> None:
            await held.pool.stop()
            for row in held.pool.drain():
                m.idle.forget(row.sandbox_id)
                await m.gateway.end(row)
                await m.instances.reap(row)

        m.instances.in_background(retire())

    def trim(self, now: float | None = None) -> None:
        """Drain the pools of built templates no create has come for in TEMPLATE_POOL_IDLE seconds."""
        now = time.monotonic() if now is None else now
        for checkpoint_id, held in list(self.snapshot_pools.items()):
            if now - held.last_used > TEMPLATE_POOL_IDLE:
                self.drop_pool(checkpoint_id)


def parent_row(manifest: Manifest, snap: Snapshot, api_key_id: str | None) -> SandboxRow:
    """The sandbox a checkpoint was taken of, as its label recorded it: what a create from it starts from."""
    info = json.loads(manifest.meta.labels["sandbox"])
    return SandboxRow(sandbox_id=snap.sandbox_id, state=State.RUNNING, template_id=info["template_id"],
                      template_digest=manifest.meta.template_digest, runtime_name="", slot=-1, address="",
                      access_token=info["access_token"], started_at=info["started_at"], end_at=0,
                      cpu=float(info["cpu"]), memory_mb=int(info["memory_mb"]), api_key_id=api_key_id,
                      settings=Settings.from_json(info["doc"]))
