"""The sandbox lifecycle, written down once (docs/design/sandbox-lifecycle.md).

    (pool) --claim--> running --kill / timeout--> killed (row deleted)
    create (cold) -----^

Every transition is recorded in the catalog before it is visible to clients, so a server
restarted after SIGKILL re-adopts running and pooled sandboxes from the catalog and the
runtime's own state, and reaps only what is really gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import string
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from keepstate.db.catalog import Catalog, SandboxRow
from keepstate.errors import BadRequest, Conflict, KeepStateError, NotFound, Unavailable
from keepstate.runtime import network
from keepstate.runtime.base import Handle, Limits, RuntimeFailure, SandboxSpec, TemplateRoot
from keepstate.runtime.gvisor import GVisorRuntime
from keepstate.session import SessionRecorder
from keepstate.template import builder
from keepstate.template.definition import load as load_definition

from .checkpointing import Checkpointing
from .durable import Durability
from .pool import Pool

log = logging.getLogger("keepstate.sandbox")

DEFAULT_TIMEOUT = 300
MAX_TIMEOUT = 24 * 3600
AGENT_READY_TIMEOUT = 60.0
SERVICE_READY_TIMEOUT = 180.0
METRIC_INTERVAL = 5.0
_ALPHABET = string.ascii_lowercase + string.digits


def handle_of(row: SandboxRow) -> Handle:
    """What the runtime needs to act on a sandbox: its runtime name and slot."""
    return Handle(row.runtime_name, row.slot)


def new_sandbox_id() -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(20))


@dataclass
class CreateRequest:
    template_id: str
    timeout: int = DEFAULT_TIMEOUT
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    auto_pause: bool = False
    cpu: float | None = None
    memory_mb: int | None = None
    allow_internet_access: bool | None = None
    gateway: bool = True  # our extension: false keeps the metering gateway's variables out


def check_timeout(value: Any, field_name: str = "timeout") -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"`{field_name}` must be a whole number of seconds")
    if value > MAX_TIMEOUT:
        raise BadRequest("Timeout cannot be greater than 24 hours")
    return int(value)


class SandboxManager(Checkpointing):
    def __init__(self, catalog: Catalog, runtime: GVisorRuntime, *, recorder: SessionRecorder,
                 durable: Durability, pool_size: int = 2, agent_version: str = "0.6.13",
                 gateway: Any = None, gateway_url: str | None = None, host_name: str = "",
                 standby_seconds: float = 300, standby_mb: int = 2048) -> None:
        self.catalog = catalog
        self.runtime = runtime
        self.recorder = recorder
        self.durable = durable
        self.gateway = gateway
        self.gateway_url = gateway_url
        self.host_name = host_name
        self.router: Any = None
        self._pausing: set[str] = set()
        self.standby_seconds = standby_seconds
        self.standby_mb = standby_mb
        self.standbys: dict[str, dict[str, Any]] = {}  # paused sandboxes still frozen in memory: doc["standby"]
        self._freezing: set[str] = set()  # being checkpointed: no host call into its agent may start
        self._agent_calls: Counter[str] = Counter()  # host calls into agents in flight, by sandbox
        self._agent_idle = asyncio.Condition()
        self._locks: dict[str, asyncio.Lock] = {}
        self.pool_size = pool_size
        self.agent_version = agent_version
        self.pools: dict[str, Pool] = {}
        self.live: dict[str, SandboxRow] = {}  # running sandboxes by public ID: the router's table
        self.metrics: dict[str, deque[dict[str, Any]]] = {}
        self._slots: set[int] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._http: aiohttp.ClientSession | None = None
        self._killing: set[str] = set()
        self._reaping: set[asyncio.Task[None]] = set()
        self._builds: dict[str, asyncio.Task[builder.Built]] = {}
        self.kill_listeners: list[Any] = []  # callables(sandbox_id) run when a sandbox dies

    # -- start and stop --------------------------------------------------------------
    async def start(self, open_ports: tuple[int, ...] = (), warm: tuple[str, ...] = ("base",)) -> None:
        # No keep-alive: an idle connection left in a sandbox's netstack would wedge its agent after a restore.
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30),
                                           connector=aiohttp.TCPConnector(limit=0, force_close=True))
        await asyncio.to_thread(network.install_firewall, open_ports)
        await self._adopt()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._expire_loop(), name="expire"))
        self._tasks.append(loop.create_task(self._metrics_loop(), name="metrics"))
        for name in warm:
            try:
                built = await asyncio.to_thread(builder.latest, name)
            except KeepStateError:
                built = None
            if built is not None:
                self._pool(built.digest, built.name).start()

    async def stop(self, reap: bool = False) -> None:
        """Stop our loops; sandboxes and pools keep running for the next server to adopt.

        With reap=True (tests, throw-away servers) every sandbox of this server is destroyed.
        """
        for pool in self.pools.values():
            await pool.stop()
        if reap:
            rows = [r for p in self.pools.values() for r in p.drain()] + list(self.live.values())
            self.live.clear()
            await asyncio.gather(*(self._reap(r) for r in rows), return_exceptions=True)
            await asyncio.gather(*(self._release_standby(s, "server stops") for s in list(self.standbys)),
                                 return_exceptions=True)
            await asyncio.gather(*self._reaping, return_exceptions=True)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        if self._http:
            await self._http.close()

    async def _sweep_orphans(self) -> None:
        """Reap sandboxes whose server's data directory was deleted (nobody can ever adopt them)."""
        for slot, name in await asyncio.to_thread(network.orphaned_slots):
            log.warning("reaping orphaned sandbox %s (its data directory is gone)", name)
            try:
                await asyncio.to_thread(self.runtime.destroy, Handle(name, slot))
            except Exception as exc:
                log.warning("destroy of orphan %s failed: %s", name, exc)
            network.release_slot(slot)

    async def _adopt(self) -> None:
        await self._sweep_orphans()
        rows = self.catalog.sandboxes()
        statuses = await asyncio.to_thread(self.runtime.statuses)
        alive = {name for name, status in statuses.items() if status == "running"}
        frozen = {name for name, status in statuses.items() if status == "paused"}
        latest: dict[str, str | None] = {}
        for row in rows:
            if row.template_id not in latest:
                try:
                    b = await asyncio.to_thread(builder.latest, row.template_id)
                except KeepStateError:
                    b = None
                latest[row.template_id] = b.digest if b else None
        for row in rows:
            sb = row.doc.get("standby")
            if sb is not None and row.state == "paused":
                if sb["name"] in frozen:
                    self.standbys[row.sandbox_id] = sb
                    self._slots.add(sb["slot"])
                    log.info("adopted the standby of paused sandbox %s", row.sandbox_id)
                else:  # the host restarted or someone removed it: the checkpoint remains
                    row.doc.pop("standby")
                    row.doc["retired"] = {"name": sb["name"], "slot": sb["slot"]}
            retired = row.doc.pop("retired", None)
            if retired:  # an instance stopped by a pause whose teardown a crash interrupted
                gone = replace(row, runtime_name=retired["name"], slot=retired["slot"])
                await self._reap(gone, keep_row=True)
                self.catalog.put_sandbox(row)
            self._slots.add(row.slot)
            if row.state == "running" and row.runtime_name in frozen:
                # A pause froze it, then the server died before the checkpoint was published: it runs on.
                try:
                    await asyncio.to_thread(self.runtime.thaw, handle_of(row))
                    alive.add(row.runtime_name)
                    log.warning("sandbox %s was frozen by an unfinished pause; thawed it", row.sandbox_id)
                except RuntimeFailure as exc:
                    log.error("sandbox %s was frozen by an unfinished pause and cannot be thawed: %s",
                              row.sandbox_id, exc)
            stale_pool = row.state == "pooled" and latest.get(row.template_id) != row.template_digest
            if row.state in ("running", "pooled") and row.runtime_name in alive and not stale_pool:
                if row.state == "running":
                    self.live[row.sandbox_id] = row
                else:
                    self._pool(row.template_digest, row.template_id).adopt(row)
                log.info("adopted %s sandbox %s", row.state, row.sandbox_id)
            elif row.state in ("running", "pooled"):
                log.warning("sandbox %s is gone; reaping", row.sandbox_id)
                await self._reap(row)

    def _pool(self, digest: str, template: str) -> Pool:
        """The warm pool of one template build (keyed by its digest: a rebuilt template gets a new pool)."""
        pool = self.pools.get(digest)
        if pool is None:
            pool = self.pools[digest] = Pool(digest, self.pool_size, lambda: self._start_pooled(template),
                                             template=template)
        return pool

    # -- starting sandboxes ---------------------------------------------------------
    def _alloc_slot(self) -> int:
        for slot in range(1, network.MAX_SLOTS):
            if slot not in self._slots and network.claim_slot(slot):
                self._slots.add(slot)
                return slot
        raise Unavailable("no free network slots on this host")

    async def _start(self, built: builder.Built, limits: Limits, state: str) -> SandboxRow:
        slot = self._alloc_slot()
        name = "ks-" + secrets.token_hex(8)
        spec = SandboxSpec(name=name, template=TemplateRoot(built.name, built.digest, built.rootfs),
                           limits=limits)
        now = time.time()
        row = SandboxRow(sandbox_id=name, state=state, template_id=built.name, template_digest=built.digest,
                         runtime_name=name, slot=slot, address="", access_token="", started_at=now,
                         end_at=now, cpu=limits.cpu, memory_mb=limits.memory_mb)
        # Recorded before it exists, so a crash in between leaves a row to reap, not a stray sandbox.
        self.catalog.put_sandbox(row)
        network.record_slot_owner(slot, str(self.catalog.path.parent), name)
        try:
            handle = await asyncio.to_thread(self.runtime.create, spec, slot)
            assert handle.endpoint is not None
            row.address = handle.endpoint.address
            self.catalog.put_sandbox(row)
            await self._wait_agent(row)
            await self._wait_services(row, built)
        except BaseException:
            await self._reap(row)
            raise
        return row

    async def _built(self, template: str) -> builder.Built:
        """The template's latest build; a first use starts the build and asks the caller to retry."""
        try:
            built = await asyncio.to_thread(builder.latest, template)
        except NotFound:
            raise NotFound(f"template '{template}' not found") from None
        if built is not None:
            return built
        task = self._builds.get(template)
        if task is None or task.done():
            self._builds[template] = asyncio.get_running_loop().create_task(
                asyncio.to_thread(builder.ensure_built, template))
        raise Unavailable(f"template '{template}' is being built for its first use (about a minute); "
                          f"retry then, or run `keepstate template build {template}` ahead of time")

    async def _start_pooled(self, template: str) -> SandboxRow:
        """Start a sandbox for the pool and initialise its agent with a fresh token and the template's defaults,
        so that a create that brings no env vars of its own only has to claim it."""
        built = await self._built(template)
        d = built.defaults
        row = await self._start(built, Limits(cpu=d.cpu, memory_mb=d.memory_mb), "pooled")
        row.access_token = secrets.token_hex(16)
        try:
            await self._init_agent(row, dict(d.env), d.user, d.workdir)
        except BaseException:
            await self._reap(row)
            raise
        self.catalog.put_sandbox(row)
        return row

    async def _wait_agent(self, row: SandboxRow, timeout: float = AGENT_READY_TIMEOUT) -> None:
        assert self._http is not None
        deadline = time.monotonic() + timeout
        url = f"http://{row.address}:49983/health"
        delay = 0.005
        while True:
            try:
                async with self._http.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status < 300:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"agent of {row.sandbox_id} did not answer within {timeout:.0f}s")
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.1)

    async def _wait_services(self, row: SandboxRow, built: builder.Built) -> None:
        """A sandbox is handed out only once its template's services (e.g. the code interpreter) listen."""
        try:
            ports = [s.port for s in load_definition(built.name).services if s.port]
        except KeepStateError:
            ports = []
        deadline = time.monotonic() + SERVICE_READY_TIMEOUT
        for port in ports:
            while True:
                try:
                    _, writer = await asyncio.wait_for(asyncio.open_connection(row.address, port), timeout=2)
                    writer.close()
                    await writer.wait_closed()
                    break
                except (OSError, asyncio.TimeoutError):
                    if time.monotonic() > deadline:
                        raise RuntimeFailure(f"service port {port} of {row.sandbox_id} did not open within "
                                             f"{SERVICE_READY_TIMEOUT:.0f}s") from None
                    await asyncio.sleep(0.1)

    async def _init_agent(self, row: SandboxRow, env: dict[str, str], user: str, workdir: str,
                          previous_token: str | None = None, fork: bool = False) -> None:
        assert self._http is not None
        headers = {"X-Access-Token": previous_token} if previous_token else {}
        body: dict[str, Any] = {
            "accessToken": row.access_token, "envVars": env, "defaultUser": user, "defaultWorkdir": workdir,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "sandboxId": row.sandbox_id, "sessionId": row.doc.get("session_id", row.sandbox_id),
        }
        if fork:
            body["fork"] = {"parent": row.doc.get("forked_from"), "checkpointId": row.doc.get("checkpoint_id")}
        async with self._http.post(f"http://{row.address}:49983/init", json=body, headers=headers) as r:
            if r.status >= 300:
                raise RuntimeFailure(f"agent of {row.sandbox_id} refused init: {r.status} {await r.text()}")

    def _sandbox_env(self, row: SandboxRow) -> dict[str, str]:
        """Template env, then the metering gateway's variables, then the create request's own."""
        env = dict(row.doc.get("templateEnv", {}))
        if self.gateway is not None and self.gateway_url and row.doc.get("gateway", True):
            token = row.doc.get("gatewayToken") or self.register_gateway_run(row)
            env.update(self.gateway.sandbox_env(token, self.gateway_url))
        env.update(row.doc.get("envVars", {}))
        return env

    def register_gateway_run(self, row: SandboxRow, parent_session: str | None = None) -> str:
        """A new gateway run for this sandbox instance, bound to its current address.

        Processes keep the token they were started with (it lives in their memory), so after a
        restore or fork the gateway tells runs apart by the instance's address.
        """
        token: str = self.gateway.register_run(
            row.doc.get("session_id", row.sandbox_id), row.sandbox_id, row.api_key_id, row.doc.get("checkpoint_id"),
            parent_session_id=parent_session, source_ip=row.address)
        row.doc["gatewayToken"] = token
        return token

    async def create(self, req: CreateRequest, api_key_id: str | None) -> SandboxRow:
        if req.timeout <= 0:
            raise BadRequest("`timeout` must be a positive number of seconds")
        snap = self.find_snapshot(req.template_id)
        if snap is not None:
            return await self._create_from_snapshot(snap, req, api_key_id)
        built = await self._built(req.template_id)
        d = built.defaults
        limits = Limits(cpu=req.cpu or d.cpu, memory_mb=req.memory_mb or d.memory_mb)
        pool = self._pool(built.digest, built.name)
        pool.start()
        row = pool.take() if limits == Limits(cpu=d.cpu, memory_mb=d.memory_mb) else None
        if row is None:
            row = await self._start(built, limits, "pooled")
        old_id = row.sandbox_id
        now = time.time()
        row.sandbox_id = new_sandbox_id()
        row.state = "running"
        ready_token = row.access_token  # set when the pool initialised it; a cold start has none
        row.access_token = ready_token or secrets.token_hex(16)
        row.started_at = now
        row.end_at = now + req.timeout
        row.api_key_id = api_key_id
        row.doc = {
            "metadata": dict(req.metadata), "envVars": dict(req.env_vars), "templateEnv": dict(d.env),
            "autoPause": req.auto_pause, "allowInternetAccess": req.allow_internet_access,
            "user": d.user, "workdir": d.workdir, "session_id": row.sandbox_id, "gateway": req.gateway,
        }
        try:
            env = self._sandbox_env(row)
            if not ready_token or env != dict(d.env):
                # Something the pool could not know: this request's env vars, or its gateway token.
                await self._init_agent(row, env, d.user, d.workdir, previous_token=ready_token or None)
            self.catalog.rename_sandbox(old_id, row)
        except BaseException:
            await self._reap(row, catalog_id=old_id)
            raise
        self.live[row.sandbox_id] = row
        self.recorder.created(row.sandbox_id, row.template_id, row.template_digest, req.metadata, req.timeout,
                              agent_url=f"http://{row.address}:49983", token=row.access_token)
        return row

    async def _create_from_snapshot(self, snap: dict[str, Any], req: CreateRequest,
                                    api_key_id: str | None) -> SandboxRow:
        manifest = await asyncio.to_thread(self.durable.manifest, snap["checkpoint_id"])
        info = json.loads(manifest.meta.labels["sandbox"])
        parent = SandboxRow(sandbox_id=snap["sandbox_id"], state="running", template_id=info["template_id"],
                            template_digest=manifest.meta.template_digest, runtime_name="", slot=-1, address="",
                            access_token=info["access_token"], started_at=info["started_at"], end_at=0,
                            cpu=float(info["cpu"]), memory_mb=int(info["memory_mb"]), api_key_id=api_key_id,
                            doc={**info["doc"], "metadata": dict(req.metadata),
                                 "envVars": {**info["doc"].get("envVars", {}), **req.env_vars},
                                 "autoPause": req.auto_pause})
        result = (await self.spawn_from(manifest, parent, 1, req.timeout, api_key_id))[0]
        if "error" in result:
            raise result["error"]
        return result["row"]

    # -- reading -------------------------------------------------------------------
    def get(self, sandbox_id: str) -> SandboxRow:
        row = self.live.get(sandbox_id) or self.catalog.get_sandbox(sandbox_id)
        if row is None or row.state not in ("running", "paused"):
            raise NotFound(f"sandbox \"{sandbox_id}\" not found")
        return row

    def listed(self) -> list[SandboxRow]:
        return self.catalog.sandboxes(("running", "paused"))

    def route(self, sandbox_id: str) -> SandboxRow | None:
        row = self.live.get(sandbox_id)
        if row is None or sandbox_id in self._killing or sandbox_id in self._pausing:
            return None
        return row

    # -- changing ------------------------------------------------------------------
    async def set_timeout(self, sandbox_id: str, seconds: int) -> None:
        row = self.get(sandbox_id)
        if row.state != "running":
            raise Conflict(f"sandbox '{sandbox_id}' is {row.state}; connect to resume it first")
        row.end_at = time.time() + max(0, seconds)
        self.catalog.put_sandbox(row)
        self.recorder.record(row.doc.get("session_id", sandbox_id), "sandbox.timeout.set", {"timeout": seconds})
        if seconds <= 0:
            await self._expire(row)

    async def connect(self, sandbox_id: str, timeout: int) -> tuple[SandboxRow, bool]:
        row = self.live.get(sandbox_id) or self.catalog.get_sandbox(sandbox_id)
        if row is None or row.state not in ("running", "paused"):
            row = await asyncio.to_thread(self._row_from_store, sandbox_id)
            if row is None:
                raise NotFound(f"sandbox \"{sandbox_id}\" not found")
        async with self._lock(sandbox_id):
            if row.state == "running":
                row.end_at = max(row.end_at, time.time() + timeout)  # never shortened
                self.catalog.put_sandbox(row)
                self.recorder.record(row.doc.get("session_id", sandbox_id), "sandbox.connect", {"timeout": timeout})
                return row, False
            return await self._resume(row, timeout), True

    async def kill(self, sandbox_id: str) -> None:
        row = self.get(sandbox_id)
        if row.state == "paused":
            await self.kill_paused(row)
            return
        await self._kill(row)

    async def _kill(self, row: SandboxRow, reason: str = "kill") -> None:
        if row.state == "killed":
            # A second kill would release its network slot twice, the second time from under whichever
            # sandbox has claimed the slot since.
            return
        self._killing.add(row.sandbox_id)
        self.live.pop(row.sandbox_id, None)
        row.state = "killed"
        self.catalog.put_sandbox(row)
        self.recorder.killed(row.doc.get("session_id", row.sandbox_id), reason)
        if self.gateway is not None and row.doc.get("gatewayToken"):
            self.gateway.end_run(row.doc["gatewayToken"])
        for listener in self.kill_listeners:
            listener(row.sandbox_id)
        # Teardown takes a second or two; the sandbox is already unreachable, so do it in the background.
        self._in_background(self._reap(row))

    def _in_background(self, teardown: Coroutine[Any, Any, None]) -> None:
        """Run a teardown after the caller has answered; stop(reap=True) waits for every one of them."""
        task = asyncio.get_running_loop().create_task(teardown)
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    def _release_slot(self, slot: int) -> None:
        network.release_slot(slot)
        self._slots.discard(slot)

    async def _reap(self, row: SandboxRow, catalog_id: str | None = None, keep_row: bool = False) -> None:
        """Destroy the runtime side of a sandbox; drop its catalog row unless keep_row (paused)."""
        slot = row.slot
        owner = network.slot_owner(slot) if slot >= 0 else None
        if owner is not None and row.runtime_name and owner != row.runtime_name:
            # Reaped before, and the slot has been claimed by another sandbox since: not ours to tear down.
            log.warning("slot %d of %s belongs to %s now; leaving it", slot, row.runtime_name, owner)
            slot = -1
        if row.runtime_name:
            try:
                await asyncio.to_thread(self.runtime.destroy, Handle(row.runtime_name, slot))
            except Exception as exc:
                log.warning("destroy of %s failed: %s", row.runtime_name, exc)
        if not keep_row:
            self.catalog.delete_sandbox(catalog_id or row.sandbox_id)
        if slot >= 0:
            self._release_slot(slot)
        self._killing.discard(row.sandbox_id)
        self.metrics.pop(row.sandbox_id, None)

    async def _expire(self, row: SandboxRow) -> None:
        if row.doc.get("autoPause"):
            log.info("sandbox %s reached its timeout; pausing it (autoPause)", row.sandbox_id)
            try:
                await self.pause(row.sandbox_id)
                return
            except Exception as exc:  # never lose it silently: a failed pause leaves it running
                log.error("auto-pause of %s failed: %s; keeping it running for 60 s more", row.sandbox_id, exc)
                row.end_at = time.time() + 60
                return
        log.info("sandbox %s reached its timeout", row.sandbox_id)
        await self._kill(row, "timeout")

    async def _expire_loop(self) -> None:
        while True:
            now = time.time()
            for row in list(self.live.values()):
                if row.end_at <= now and row.sandbox_id not in self._killing and row.sandbox_id not in self._pausing:
                    try:
                        await self._expire(row)
                    except Exception as exc:
                        log.warning("expiry of %s failed: %s", row.sandbox_id, exc)
            if self.standbys:
                try:
                    await self.trim_standbys()
                except Exception as exc:
                    log.warning("releasing standbys failed: %s", exc)
            await asyncio.sleep(0.25)

    # -- metrics -------------------------------------------------------------------
    async def _metrics_loop(self) -> None:
        last: dict[str, tuple[float, int]] = {}
        while True:
            for row in list(self.live.values()):
                if row.sandbox_id in self._freezing or row.sandbox_id in self._pausing:
                    continue  # being checkpointed, or frozen by a pause until it is published
                try:
                    sample = await self._sample(row, last)
                except Exception as exc:  # a sandbox dying mid-sample is normal
                    log.debug("metrics of %s: %s", row.sandbox_id, exc)
                    continue
                if sample:
                    self.metrics.setdefault(row.sandbox_id, deque(maxlen=720)).append(sample)
                else:
                    await self._check_alive(row)
            await asyncio.sleep(METRIC_INTERVAL)

    async def _check_alive(self, row: SandboxRow) -> None:
        """No cgroup figures: the sandbox may have died (OOM kill, crash). If runsc agrees, record it gone."""
        sid = row.sandbox_id
        if self.live.get(sid) is not row or sid in self._killing or sid in self._pausing or sid in self._freezing:
            return  # killed, paused or replaced meanwhile, or frozen by a checkpoint: not ours to declare dead
        if not await asyncio.to_thread(self.runtime.is_alive, handle_of(row)):
            log.warning("sandbox %s died (its runsc container is gone: out of memory or a crash)", row.sandbox_id)
            await self._kill(row, "died")

    async def _sample(self, row: SandboxRow, last: dict[str, tuple[float, int]]) -> dict[str, Any] | None:
        stats = await asyncio.to_thread(self.runtime.cgroup_stats, handle_of(row))
        if not stats:
            return None
        now = time.time()
        cpu_ns = stats.get("cpu_ns", 0)
        prev = last.get(row.sandbox_id)
        last[row.sandbox_id] = (now, cpu_ns)
        pct = 0.0
        if prev and now > prev[0]:
            pct = max(0.0, (cpu_ns - prev[1]) / 1e9 / (now - prev[0]) / max(row.cpu, 1) * 100)
        disk_used = disk_total = 0
        assert self._http is not None
        try:
            async with self._agent_call(row.sandbox_id) as allowed:
                if not allowed:
                    return None
                async with self._http.get(f"http://{row.address}:49983/metrics",
                                          headers={"X-Access-Token": row.access_token},
                                          timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        m = await r.json()
                        disk_used, disk_total = int(m.get("disk_used", 0)), int(m.get("disk_total", 0))
        except (aiohttp.ClientConnectorError, asyncio.TimeoutError):
            # The agent does not answer: if runsc says the sandbox is gone (its sentry was OOM-killed), say so.
            await self._check_alive(row)
            if row.sandbox_id not in self.live:
                return None
        except (aiohttp.ClientError, ValueError):
            pass
        mem_total = min(stats.get("mem_limit", 0), row.memory_mb * 1024 * 1024) or row.memory_mb * 1024 * 1024
        return {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z",
            "timestampUnix": int(now), "cpuCount": int(row.cpu), "cpuUsedPct": round(pct, 2),
            "memUsed": stats.get("mem_used", 0), "memTotal": mem_total, "memCache": stats.get("mem_cache", 0),
            "diskUsed": disk_used, "diskTotal": disk_total,
        }

    @contextlib.asynccontextmanager
    async def _agent_call(self, sandbox_id: str) -> AsyncIterator[bool]:
        """Around a host-initiated call into a sandbox's agent: yields False (make no call) while the sandbox
        is being checkpointed; a checkpoint waits for calls in flight (see Checkpointing._frozen)."""
        if sandbox_id in self._freezing:
            yield False
            return
        self._agent_calls[sandbox_id] += 1
        try:
            yield True
        finally:
            self._agent_calls[sandbox_id] -= 1
            if not self._agent_calls[sandbox_id]:
                del self._agent_calls[sandbox_id]
                async with self._agent_idle:
                    self._agent_idle.notify_all()

    async def _agent_calls_done(self, sandbox_id: str) -> None:
        async with self._agent_idle:
            await self._agent_idle.wait_for(lambda: not self._agent_calls[sandbox_id])

    def metric_samples(self, sandbox_id: str, start: float | None, end: float | None) -> list[dict[str, Any]]:
        self.get(sandbox_id)
        out = []
        for s in self.metrics.get(sandbox_id, ()):
            if start is not None and s["timestampUnix"] < start:
                continue
            if end is not None and s["timestampUnix"] > end:
                continue
            out.append(s)
        return out
