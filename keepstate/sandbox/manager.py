"""The sandbox manager: the lifecycle commands' bodies, run by the sandbox table's executor (table.py).

Every command on an existing sandbox runs inside `table.command(sandbox_id, Command.X)`: the sandbox's lock is
taken, its *current* record is read, (command, state) is looked up in state.TRANSITIONS, the transient state is
written, and only then does the body here act; the executor writes the state on success or failure. So concurrent
commands on one sandbox are serialised, an illegal one is refused with a JSON 409 (or 404 once it is gone), and
none acts on a record another command changed. Nothing here writes a sandbox's state itself.

Every transition is written to the catalog before it is visible to clients, so a server restarted after SIGKILL
re-adopts sandboxes from the catalog and the runtime's own state (adopt.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import types
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keepstate.config import DEFAULT_DISK_MB
from keepstate.db.engine import Database
from keepstate.db.repos import Keys
from keepstate.db.setup import LOCAL_NODE
from keepstate.egress.policy import Policy
from keepstate.egress.service import Egress, EgressConfig
from keepstate.errors import BadRequest, Conflict, Draining, NotFound, Unavailable, Unsupported
from keepstate.runtime.base import Runtime
from keepstate.session import SessionRecorder
from keepstate.session.journal import JournalBusy
from keepstate.store import Manifest
from keepstate.template.builder import Built
from keepstate.volume import Volumes

from . import adopt, loops, recovery
from .admission import AdmissionConfig, Places
from .agent_client import AgentClient, Quiesced, agent_url
from .boot_images import BootImages
from .checkpoints import MAX_FORKS, Checkpoints, Spawned
from .creates import DEFAULT_TIMEOUT, MAX_TIMEOUT, CreateRequest, Creates, check_timeout
from .durable import Durability
from .gateway_runs import GatewayRuns
from .idle import DEFAULT_AFTER, IdleFreezer
from .instances import Instances, handle_of
from .pool import WarmPool
from .record import Instance, SandboxRow, Snapshot
from .rows import SandboxRows
from .slots import Slots
from .standby import StandbyCache
from .state import Command, State, listed
from .table import SandboxTable, Step
from .templates import Templates

if TYPE_CHECKING:
    from keepstate.gateway.gateway import Gateway
    from keepstate.secret import SecretStore

log = logging.getLogger("keepstate.sandbox")


class _NotDead(Exception):
    """died(): the instance is alive after all, or another one took its place."""

# Running, or on its way to or from it: a place of its API key's and an instance on the host.
ACTIVE = (State.RUNNING, State.CHECKPOINTING, State.PAUSING, State.RESUMING)

__all__ = ["CreateRequest", "DEFAULT_TIMEOUT", "MAX_FORKS", "MAX_TIMEOUT", "SandboxManager", "Spawned",
           "check_timeout"]


class SandboxManager:
    def __init__(self, db: Database, runtime: Runtime, *, home: Path, templates: Templates, recorder: SessionRecorder,
                 durable: Durability, pool_size: int = 2, template_pool_size: int = 1, gateway: Gateway | None = None,
                 gateway_url: str | None = None, host_name: str = "", standby_seconds: float = 300,
                 standby_mb: int = 2048, disk_mb: int = DEFAULT_DISK_MB, volumes: Volumes | None = None,
                 admission: AdmissionConfig | None = None, boot_images: bool = True,
                 freeze_idle_after: float = DEFAULT_AFTER, secrets: SecretStore | None = None,
                 egress: Egress | None = None, node_id: str = LOCAL_NODE, checkpoint_every: int = 0) -> None:
        self.db = db
        self.home = home
        self.rows = SandboxRows(db, node_id)
        self.keys = Keys(db)
        self._key_limits: dict[str, tuple[str, int | None]] = {}  # read at each create, resume and fork
        self.secrets = secrets  # the egress service asks it `exists(name)` (policies) and `value(name)` (the proxy)
        self.runtime = runtime
        self.templates = templates
        self.recorder = recorder
        self.durable = durable
        self.host_name = host_name
        self.pool_size = pool_size
        self.template_pool_size = template_pool_size
        self.disk_mb = disk_mb
        self.agents = AgentClient()
        self.slots = Slots(runtime.slots, str(home))
        self.volumes = volumes
        # Without one (tests of the manager alone): policies are remembered, nothing leaves.
        self.egress = egress or Egress(home, EgressConfig(enabled=False), datapath=runtime.kind != "fake")
        self.egress.on_host = self._egress_host
        admission = admission or AdmissionConfig()
        self.instances = Instances(self.rows, runtime, self.slots, self.agents, templates,
                                   admission.start_queue_for(), volumes,
                                   BootImages(home, runtime, boot_images), self.egress)
        self.places = Places(admission.host_limit(runtime.slots.max_slots - 1), admission.max_sandboxes_per_key,
                             self._on_host, self._running_of, self._key_limit)
        self.gateway = GatewayRuns(gateway, gateway_url)
        self.checkpoints = Checkpoints(self.instances, durable, recorder, self.agents, self.gateway, runtime,
                                       host_name)
        self.standbys = StandbyCache(standby_seconds, standby_mb)
        self.table = SandboxTable(self.rows)  # the one writer of sandboxes' records and states
        self.pools: dict[str, WarmPool] = {}
        self.metrics = loops.MetricSamples()
        self._tasks: list[asyncio.Task[None]] = []
        self._waking: dict[str, asyncio.Task[tuple[SandboxRow, bool]]] = {}  # autoResume's resumes, by sandbox ID
        self.creates = Creates(self)
        if recorder.poller is not None:
            recorder.poller.fetch = self._journal_fetch
        self.idle = IdleFreezer(self, freeze_idle_after)  # docs/design/idle.md; 0 disables freezing
        self.policy = recovery.CheckpointPolicy(self, checkpoint_every)
        # Built templates (builds/service.py) resolve here like snapshots: ref -> a Snapshot.
        self.template_resolver: Callable[[str], Awaitable[Snapshot | None]] | None = None
        self.refusing: Callable[[], str | None] = lambda: None  # why this node takes no creates now (a drain)

    # -- start and stop ---------------------------------------------------------------------------------------
    async def start(self, open_ports: tuple[int, ...] = (), warm: tuple[str, ...] = ("base",)) -> None:
        await self.agents.start()
        await asyncio.to_thread(self.egress.prepare_host, open_ports)
        await asyncio.to_thread(self.runtime.prepare, open_ports)
        await self.egress.start()  # before adoption, which re-attaches live sandboxes to this resolver and proxy
        await adopt.adopt(self)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(loops.expire_loop(self), name="expire"))
        self._tasks.append(loop.create_task(loops.metrics_loop(self), name="metrics"))
        if self.idle.enabled:
            self._tasks.append(loop.create_task(self.idle.run(), name="idle-freezer"))
        self._tasks.append(loop.create_task(self.policy.run(), name="checkpoint-policy"))
        for name in warm:
            with contextlib.suppress(Exception):
                built = await asyncio.to_thread(self.templates.latest, name)
                if built is not None:
                    self.pool(built).start()

    async def stop(self, reap: bool = False) -> None:
        """Stop our loops; sandboxes and pools keep running for the next server to adopt.

        With reap=True (tests, throw-away servers) every sandbox of this server is destroyed.
        """
        self.instances.starts.close()  # a refill waiting for a start slot gives up (its pool is stopping)
        for pool in self.pools.values():
            await pool.stop()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self.idle.wake_all()  # what the next server adopts runs (any server, of any release, can then reach it)
        if reap:
            rows = [r for p in self.pools.values() for r in p.drain()]
            rows += [r for r in self.table.all() if r.runtime_name]
            await asyncio.gather(*(self.instances.reap(r) for r in rows), return_exceptions=True)
            await asyncio.gather(*(self.release_standby(s, "server stops") for s in self.standbys.ids()),
                                 return_exceptions=True)
            self.table.drop()
        await self.table.close()
        await self.instances.drain()
        await self.instances.teardowns.stop()
        await self.egress.stop()
        await self.agents.close()

    def pool(self, built: Built) -> WarmPool:
        return self.creates.pool(built)

    # -- reading (the table's query methods) --------------------------------------------------------------------
    @property
    def records(self) -> Mapping[str, SandboxRow]:
        """Every sandbox of the table's, by ID: read-only."""
        return types.MappingProxyType(self.table._records)

    def get(self, sandbox_id: str) -> SandboxRow:
        return self.table.get(sandbox_id)

    def listed(self) -> list[SandboxRow]:
        return self.table.listed()

    def running(self) -> list[SandboxRow]:
        return self.table.running()

    def route(self, sandbox_id: str) -> SandboxRow | None:
        return self.table.route(sandbox_id)

    # -- places (admission.py): what holds one now ------------------------------------------------------------
    def _on_host(self) -> int:
        """Instances on this host: listed sandboxes that have one (a standby too), pooled ones ready or starting."""
        held = sum(1 for r in self.table.all() if r.state in ACTIVE
                   or (r.state == State.PAUSED and r.settings.standby is not None))
        return held + sum(len(p) + p.starting for p in self.pools.values())

    def _running_of(self, key_id: str) -> int:
        return sum(1 for r in self.table.all() if r.api_key_id == key_id and r.state in ACTIVE)

    def _key_limit(self, key_id: str) -> tuple[str, int | None]:
        return self._key_limits.get(key_id, (key_id, None))

    async def _read_key_limit(self, key_id: str | None) -> None:
        """Read the key's own limit before admission asks for it (`keepstate keys limit` holds from the next call)."""
        if key_id:
            key = await self.keys.get(key_id)
            self._key_limits[key_id] = (key.name, key.max_sandboxes) if key is not None else (key_id, None)

    def admission(self) -> dict[str, Any]:
        """The figures /health reports."""
        return {"starts": self.instances.starts.figures(), "sandboxes": self.places.figures()}

    def teardowns_pending(self) -> int:
        """Instances killed or released and not yet fully torn down (docs/design/teardown.md)."""
        return self.instances.teardowns.pending()

    def metric_samples(self, sandbox_id: str, start: float | None, end: float | None) -> list[dict[str, Any]]:
        self.get(sandbox_id)
        return self.metrics.between(sandbox_id, start, end)

    def latest_metrics(self, sandbox_ids: list[str]) -> dict[str, dict[str, Any]]:
        return self.metrics.latest(sandbox_ids, lambda sid: (r := self.table.find(sid)) is not None and listed(r.state))

    def command_running(self, sandbox_id: str) -> bool:
        """Whether a lifecycle command holds or awaits the sandbox's lock."""
        return self.table.command_running(sandbox_id)

    # -- create -------------------------------------------------------------------------------------------------
    async def check_secrets(self, policy: Policy) -> None:
        """A policy may name only secrets that exist (a 400 otherwise: nothing is created or changed)."""
        store = self.secrets
        missing = sorted([n for n in policy.secret_names() if store is None or not await store.exists(n)])
        if missing:
            raise BadRequest(f"`network.rules` names secret(s) that do not exist: {', '.join(missing)} "
                             f"(create them with POST /secrets first)")

    async def create(self, req: CreateRequest, api_key_id: str | None) -> SandboxRow:
        if (why := self.refusing()) is not None:
            raise Draining(why)
        if req.network:
            await self.check_secrets(Policy.from_json(req.network))
        await self._read_key_limit(api_key_id)
        if not req.volume_mounts or await self.find_snapshot(req.template_id) is not None:
            return await self.creates.create(req, api_key_id, [])
        if self.volumes is None:
            raise Unsupported("this server has no volume store")
        async with self.volumes.pinned(name for name, _ in req.volume_mounts) as found:
            mounts = [{"name": name, "path": path, "volume_id": found[name].volume_id}
                      for name, path in req.volume_mounts]
            return await self.creates.create(req, api_key_id, mounts)

    # -- commands on one sandbox --------------------------------------------------------------------------------
    async def update_network(self, sandbox_id: str, body: Any) -> None:
        """`PUT /sandboxes/{id}/network`: the egress policy replaced whole, applied at once."""
        async with self.table.command(sandbox_id, Command.NETWORK_UPDATE) as step:
            row = step.row
            policy = row.settings.policy.updated(body)  # BadRequest: nothing changed
            await self.check_secrets(policy)
            await asyncio.to_thread(self.egress.update, row.slot, row.sandbox_id, policy)
            row.settings.network = policy.to_json()
            if isinstance(body, dict) and ("allow_internet_access" in body or "allowInternetAccess" in body):
                row.settings.allow_internet_access = policy.allow_internet_access
            await self.table.save(row)
            await self.recorder.record(row.session_id, "sandbox.network.update", {"network": policy.to_wire()})

    def _egress_host(self, sandbox_id: str, data: dict[str, Any]) -> None:
        """The first connection of a sandbox to a host: a history event (written once the caller has gone on)."""
        row = self.table.find(sandbox_id)
        if row is not None:
            self.instances.in_background(self._egress_host_event(row.session_id, data))

    async def _egress_host_event(self, session_id: str, data: dict[str, Any]) -> None:
        try:
            await self.recorder.record(session_id, "egress.host", data)
        except Exception as exc:  # the history is best effort here: never break egress over it
            log.warning("egress.host event for %s: %s", session_id, exc)

    async def set_timeout(self, sandbox_id: str, seconds: int) -> None:
        async with self.table.command(sandbox_id, Command.SET_TIMEOUT) as step:
            row = step.row
            row.end_at = time.time() + max(0, seconds)
            await self.table.save(row)
            await self.recorder.record(row.session_id, "sandbox.timeout.set", {"timeout": seconds})
            if seconds <= 0:
                async with step.then(Command.EXPIRE) as expiring:
                    await self._expire(expiring)

    async def expire(self, sandbox_id: str) -> None:
        """Its end time passed (the expiry loop): kill it, or pause it if it asked for autoPause."""
        async with self.table.command(sandbox_id, Command.EXPIRE) as step:
            if step.row.end_at <= time.time():
                await self._expire(step)

    async def _expire(self, step: Step) -> None:
        row = step.row
        if row.settings.auto_pause:
            # Files only where the sandbox has a disk: what pause()'s admit checks, so the hand-over needs none.
            files_only = not row.settings.auto_pause_memory and bool(row.settings.disk_mb)
            log.info("sandbox %s reached its timeout; pausing it (autoPause%s)", row.sandbox_id,
                     ", files only" if files_only else "")
            try:
                async with step.then(Command.PAUSE_FILESYSTEM if files_only else Command.PAUSE) as pausing:
                    await self._pause(pausing, memory=not files_only)
                return
            except Exception as exc:  # never lose it silently: a failed pause leaves it running
                log.error("auto-pause of %s failed: %s; keeping it running for 60 s more", row.sandbox_id, exc)
                row.end_at = time.time() + 60
                await self.table.save(row)
                return
        log.info("sandbox %s reached its timeout", row.sandbox_id)
        async with step.then(Command.KILL) as killing:
            await self._kill_running(killing, "timeout")

    async def connect(self, sandbox_id: str, timeout: int, memory: bool = True) -> tuple[SandboxRow, bool]:
        """(row, resumed): a running sandbox's timeout is extended (never shortened); a paused one resumes, or
        without `memory` reboots from its files."""
        await self._known(sandbox_id)
        admit = functools.partial(self._admit_resume, memory=memory)
        async with self.table.command(sandbox_id, Command.CONNECT, admit=admit) as step:
            row = step.row
            if step.origin == State.RUNNING:
                await self._keep_alive(row, timeout)
                await self.recorder.record(row.session_id, "sandbox.connect", {"timeout": timeout})
                return row, False
            await self._resume(step, timeout, memory)
            return row, True

    async def resume(self, sandbox_id: str, timeout: int, auto_pause: bool | None = None,
                     memory: bool = True) -> SandboxRow:
        """E2B's older resume: a paused sandbox only (a running one is a 409); `auto_pause`, when given, is what
        its next timeout does."""
        await self._known(sandbox_id)
        admit = functools.partial(self._admit_resume, memory=memory)
        async with self.table.command(sandbox_id, Command.RESUME, admit=admit) as step:
            await self._resume(step, timeout, memory)
            if auto_pause is not None:
                step.row.settings.auto_pause = auto_pause
                await self.table.save(step.row)
            return step.row

    async def wake(self, row: SandboxRow) -> None:
        """Resume a paused sandbox with autoResume for traffic that found it so: concurrent callers wait on one
        resume, which a caller that gives up does not cancel."""
        task = self._waking.get(row.sandbox_id)
        if task is None:
            timeout = row.settings.starting_timeout or DEFAULT_TIMEOUT
            log.info("traffic for paused sandbox %s: resuming it (autoResume, timeout %d s)", row.sandbox_id, timeout)
            task = self._waking[row.sandbox_id] = asyncio.ensure_future(self.connect(row.sandbox_id, timeout))
            task.add_done_callback(lambda _: self._waking.pop(row.sandbox_id, None))
        await asyncio.shield(task)

    async def refresh(self, sandbox_id: str, seconds: int) -> None:
        """Keep a running sandbox alive `seconds` from now; its end time is extended, never shortened."""
        async with self.table.command(sandbox_id, Command.REFRESH) as step:
            await self._keep_alive(step.row, seconds)
            await self.recorder.record(step.row.session_id, "sandbox.refresh", {"duration": seconds})

    async def _keep_alive(self, row: SandboxRow, seconds: int) -> None:
        row.end_at = max(row.end_at, time.time() + seconds)
        await self.table.save(row)

    async def _known(self, sandbox_id: str) -> None:
        await recovery.known(self, sandbox_id)  # a gone node's is taken over; one in the store loaded

    async def _admit_resume(self, row: SandboxRow, memory: bool = True) -> None:
        """A paused sandbox runs again: a place of its key's, and a new instance unless its standby thaws. Looked
        at before RESUMING, which holds them from then on. A reboot (not `memory`) is what E2B's 409 asks for."""
        if row.state == State.PAUSED:
            if row.settings.envd_unresponsive and not row.settings.files_only and memory:
                raise Conflict(f"sandbox {row.sandbox_id} was paused while its agent did not answer: restoring that "
                               "memory would bring the unresponsive agent back; reboot it from its files "
                               "(memory: false)", error_code="sandbox_snapshot_guest_agent_unresponsive")
            await self._read_key_limit(row.api_key_id)
            self.places.check(row.api_key_id, host=0 if row.settings.standby is not None and memory else 1, key=1)

    async def _resume(self, step: Step, timeout: int, memory: bool = True) -> None:
        row = step.row
        source = "store"
        try:
            if not memory and not row.settings.files_only:  # a reboot from files: sandbox-disk.md
                standby, row.settings.standby = row.settings.standby, None
                self.standbys.discard(row.sandbox_id)
                await self.checkpoints.files_from_memory(row, standby)
            standby = row.settings.standby
            if standby is not None:
                self.standbys.discard(row.sandbox_id)
                row.settings.standby = None
                if await self.checkpoints.thaw(row, standby, timeout):
                    source = "standby"
            if source == "store":
                await self.checkpoints.restore(row, timeout, pooled=self.creates.pooled)
        except BaseException:
            row.runtime_name, row.slot, row.address = "", -1, ""
            raise
        row.settings.files_only = False
        await step.done()
        assert row.settings.checkpoint_id is not None
        await self.recorder.resumed(row.session_id, row.settings.checkpoint_id, self.host_name,
                                    agent_url=agent_url(row.address), token=row.access_token, source=source)

    async def pause(self, sandbox_id: str, memory: bool = True, require_healthy: bool = False) -> str:
        async with self.table.command(sandbox_id, Command.PAUSE if memory else Command.PAUSE_FILESYSTEM,
                                      admit=self._admit_pause if not memory else None) as step:
            return await self._pause(step, memory, require_healthy)

    async def _admit_pause(self, row: SandboxRow) -> None:
        if not row.settings.disk_mb:
            raise Unsupported(f"sandbox {row.sandbox_id} keeps its files in memory (it was started by a release "
                              "before the disk): it can only pause with memory")

    async def _pause(self, step: Step, memory: bool = True, require_healthy: bool = False) -> str:
        """Checkpoint the sandbox and stop its instance. Without memory only its files are kept, the instance is
        torn down once they are published, and a resume cold-boots a new one with them (docs/design/sandbox-disk.md).
        An agent that does not answer is recorded on the pause (a resume with memory is then refused), or refuses
        it (503, the sandbox runs on) with `require_healthy` or without memory (its files need the agent)."""
        row = step.row
        self.idle.wake(row.sandbox_id)
        healthy = await self.agents.healthy(row.sandbox_id, row.address)
        if not healthy and (require_healthy or not memory):
            raise Unavailable(f"sandbox {row.sandbox_id}'s agent does not answer: not paused"
                              f"{' (requireHealthyGuest)' if memory else ' (a filesystem-only pause needs it)'}")
        row.settings.envd_unresponsive = not healthy
        self.agents.abort(row.sandbox_id)  # in-flight streams end now; new requests get 502 (not RUNNING)
        manifest = await (self.checkpoints.take(row, "pause", healthy) if memory else self.checkpoints.take_files(row))
        instance = row.instance()
        await asyncio.to_thread(self.egress.detach, row.slot, row.sandbox_id)  # a paused sandbox sends nothing
        row.settings.checkpoint_id = manifest.checkpoint_id
        row.settings.files_only = not memory
        if memory and self.standbys.enabled:
            # The instance stays frozen in exactly the checkpoint's state: resuming it soon is a thaw.
            stats = await asyncio.to_thread(self.runtime.cgroup_stats, handle_of(row))
            standby = Instance(instance.name, instance.slot, instance.address, since=time.time(),
                               mem=stats.get("mem_used") or row.memory_mb << 20)
            row.settings.standby = standby
            self.standbys.add(row.sandbox_id, standby)
        else:
            # Torn down in the background; remembered until then, so a server killed meanwhile reaps it.
            row.settings.retired = instance
        retired = row.with_instance(instance)
        row.runtime_name, row.address, row.slot = "", "", -1
        await step.done()
        await self.recorder.paused(row.session_id, manifest.checkpoint_id, memory)
        if row.settings.retired is not None:
            self.instances.in_background(self._retire(row.sandbox_id, retired))
        return manifest.checkpoint_id

    async def _retire(self, sandbox_id: str, instance_row: SandboxRow) -> None:
        """Tear down an instance a pause stopped (or a released standby), then forget it in the record."""
        await self.instances.reap(instance_row, keep_row=True)
        async with self.table.amend(sandbox_id) as row:
            if row is not None and row.settings.retired is not None \
                    and row.settings.retired.name == instance_row.runtime_name:
                row.settings.retired = None
                await self.table.save(row)

    async def release_standby(self, sandbox_id: str, why: str) -> None:
        """Destroy a paused sandbox's standby; its checkpoint stays, so a resume restores from the store."""
        async with self.table.amend(sandbox_id) as row:
            self.standbys.discard(sandbox_id)
            if row is None or row.state != State.PAUSED or row.settings.standby is None:
                return
            log.info("releasing the standby of paused sandbox %s (%s)", sandbox_id, why)
            standby, row.settings.standby = row.settings.standby, None
            row.settings.retired = standby  # until it is gone: a server killed meanwhile reaps it on start
            await self.table.save(row)
        await self._retire(sandbox_id, row.with_instance(standby))

    async def trim_standbys(self) -> None:
        for sandbox_id, why in self.standbys.due(time.time()):
            await self.release_standby(sandbox_id, why)

    async def snapshot(self, sandbox_id: str, name: str | None, memory: bool = True) -> dict[str, Any]:
        """A snapshot of a running sandbox, which runs on: its memory, processes and files, or (`memory` false) its
        files only (its processes stopped while they are exported; a sandbox made from it is a cold boot)."""
        if name is not None and (not isinstance(name, str) or not name.strip() or len(name) > 128):
            raise BadRequest("`name` must be a non-empty string of at most 128 characters")
        async with self.table.command(sandbox_id, Command.SNAPSHOT, admit=None if memory else self._admit_pause) \
                as step:
            # Files only: not the row's own latest checkpoint (a resume or a take-over restores memory from that).
            manifest = await (self._capture(step, "snapshot") if memory else self.checkpoints.take_files(step.row,
                                                                                                     "snapshot"))
            row = step.row
        snapshot_id = f"snapshot-{manifest.checkpoint_id.lower()}"
        names = [name.strip()] if name else [snapshot_id]
        await self.rows.put_snapshot(snapshot_id, names, manifest.checkpoint_id, sandbox_id, row.template_id)
        return {"snapshotID": snapshot_id, "names": names}

    async def _capture(self, step: Step, kind: str) -> Manifest:
        """A running sandbox's checkpoint (it runs on): its transition is CHECKPOINTING -> RUNNING."""
        manifest = await self.checkpoints.take(step.row, kind)
        step.row.settings.checkpoint_id, step.row.settings.checkpoint_at = manifest.checkpoint_id, time.time()
        return manifest

    async def checkpoint(self, sandbox_id: str, kind: str = "snapshot") -> str:
        """A checkpoint with no snapshot record: a template build's layers and templates, which the build service
        names itself (docs/design/template-builds.md), or a checkpoint policy's (kind `policy`: recovery.py)."""
        async with self.table.command(sandbox_id, Command.CHECKPOINT) as step:
            manifest = await self._capture(step, kind)
        return manifest.checkpoint_id

    async def set_defaults(self, sandbox_id: str, user: str, workdir: str, env: dict[str, str],
                           metadata: dict[str, str] | None = None) -> None:
        """A running sandbox's default user, workdir and env, in its record (which its checkpoints carry to every
        sandbox made from them) and in its agent: a template build's finish. `metadata` is added to its own (a
        checkpoint's label carries it: what lets another server sharing the store find a template)."""
        async with self.table.command(sandbox_id, Command.SET_DEFAULTS) as step:
            row = step.row
            row.settings.user, row.settings.workdir = user, workdir
            row.settings.metadata.update(metadata or {})
            row.settings.template_env = {**row.settings.template_env, **env}
            await self.table.save(row)
            await self.instances.init_agent(row, await self.gateway.env(row), previous_token=row.access_token)

    async def find_snapshot(self, ref: str) -> Snapshot | None:
        snap = await self.rows.find_snapshot(ref)
        if snap is not None:
            return snap
        return await self.template_resolver(ref) if self.template_resolver is not None else None

    async def fork(self, sandbox_id: str, count: int, timeout: int, memory: bool = True) -> list[Spawned]:
        """`count` diverging copies of a running sandbox: restored from its memory, or (`memory` false) cold boots
        with its files (E2B's filesystem-only fork)."""
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORKS:
            raise BadRequest(f"`count` must be a whole number from 1 to {MAX_FORKS}")
        with contextlib.ExitStack() as places:
            async with self.table.command(sandbox_id, Command.FORK, admit=None if memory else self._admit_pause) \
                    as step:
                await self._read_key_limit(step.row.api_key_id)
                # All the children's places or none, before the parent is checkpointed.
                places.enter_context(self.places.reserve(step.row.api_key_id, host=count, key=count))
                manifest = await (self._capture(step, "fork") if memory else self.checkpoints.take_files(step.row,
                                                                                                       "fork"))
                parent = step.row.copy()
            return await self.spawn(manifest, parent, count, timeout)

    async def spawn(self, manifest: Manifest, parent: SandboxRow, count: int, timeout: int,
                     api_key_id: str | None = None, sandbox_id: str | None = None) -> list[Spawned]:
        """Start `count` sandboxes from a checkpoint: each is born running (its row written by the restore)."""
        results = await self.checkpoints.spawn(manifest, parent, count, timeout, api_key_id, sandbox_id=sandbox_id)
        for r in results:
            if r.row is not None:
                self.table.enter(r.row)
                await self.recorder.forked(parent.session_id, r.row.sandbox_id, manifest.checkpoint_id,
                                           agent_url=agent_url(r.row.address), token=r.row.access_token)
        return results

    async def kill(self, sandbox_id: str, reason: str = "kill") -> None:
        async with self.table.command(sandbox_id, Command.KILL) as step:
            if step.origin == State.PAUSED:
                await self._kill_paused(step, reason)
            else:
                await self._kill_running(step, reason)

    async def died(self, sandbox_id: str, runtime_name: str) -> None:
        """The metrics loop found the instance gone (OOM kill, crash): record it dead, if it still is that one."""
        async def still_gone(row: SandboxRow) -> None:
            if row.runtime_name != runtime_name or await asyncio.to_thread(self.runtime.is_alive, handle_of(row)):
                raise _NotDead  # resumed or replaced meanwhile, or alive after all: not ours to declare dead
        with contextlib.suppress(NotFound, Conflict, _NotDead):
            async with self.table.command(sandbox_id, Command.DIED, admit=still_gone) as step:
                log.warning("sandbox %s died (its instance is gone: out of memory or a crash)", sandbox_id)
                await self._kill_running(step, "died")

    async def _kill_running(self, step: Step, reason: str) -> None:
        """Unreachable at once (KILLING); the teardown (a second or two) runs in the background, recorded before
        the answer: the row goes and its teardown is recorded in one transaction, the retry loop tears it down."""
        row = step.row
        await self.instances.reap_later(row.copy())
        await step.done()
        self.idle.forget(row.sandbox_id)  # left frozen: its teardown kills, then thaws
        self.agents.forget(row.sandbox_id)
        self.agents.abort(row.sandbox_id)
        await self.recorder.killed(row.session_id, reason)
        await self.gateway.end(row)
        self.metrics.forget(row.sandbox_id)
        self.egress.forget(row.sandbox_id)

    async def _kill_paused(self, step: Step, reason: str = "kill") -> None:
        row = step.row
        if row.settings.standby is not None:  # the row goes with its standby's teardown recorded, together
            await self.instances.reap_later(row.with_instance(row.settings.standby))
        else:  # a retired instance has its teardown under way already
            await self.rows.delete(row.sandbox_id)
        await step.done()
        self.standbys.discard(row.sandbox_id)
        self.egress.forget(row.sandbox_id)
        await self.gateway.end(row)
        await self.recorder.killed(row.session_id, reason)

    # -- shared store ---------------------------------------------------------------------------------------------
    async def _journal_fetch(self, session_id: str, url: str, token: str, after: int, limit: int) -> tuple[int, Any]:
        try:
            return await self.agents.journal(session_id, url, token, after, limit)
        except Quiesced as exc:
            raise JournalBusy(str(exc)) from None
