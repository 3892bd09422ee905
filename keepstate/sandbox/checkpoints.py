"""Taking checkpoints of running sandboxes, and starting instances from them: resume, fork, snapshot-create.

    any checkpoint: checkpoint event -> quiesce (AgentClient) -> [pause: freeze] -> runsc checkpoint -> ingest
                    -> publish -> record the lineage
    a pause keeps the gate closed until the checkpoint is published; a snapshot or fork lets the sandbox run on
    (and its requests through) as soon as the image is captured.

The manager calls these under the sandbox's lock, with the sandbox in a transient state (PAUSING, CHECKPOINTING,
RESUMING); nothing here changes a sandbox's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from keepstate.errors import Busy, KeepStateError
from keepstate.ports import AGENT_PORT
from keepstate.runtime.base import Endpoint, Handle, Limits, Mount, Runtime, RuntimeFailure
from keepstate.session import SessionRecorder
from keepstate.store import EventRef, Manifest
from keepstate.store.ids import new_checkpoint_id
from keepstate.template.builder import Built

from .agent_client import AgentClient
from .durable import FILES_ARCHIVE, Durability, has_memory, listening_ports
from .gateway_runs import GatewayRuns
from .instances import RESTORED_AGENT_TIMEOUT, RESTORED_PORTS_TIMEOUT, Instances, handle_of
from .record import Instance, SandboxRow, Settings
from .state import State
from .traffic import traffic_token

log = logging.getLogger("keepstate.sandbox")
MAX_FORKS = 20


def row_limits(row: SandboxRow) -> Limits:
    """The limits a sandbox was created with, for a new instance of it (its disk as its images need)."""
    return Limits(cpu=row.cpu, memory_mb=row.memory_mb, disk_mb=row.settings.disk_mb)


def new_sandbox_id() -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(20))


@dataclass
class Spawned:
    """One sandbox started from a checkpoint (a fork, or a create from a snapshot): its row, or why it failed."""

    row: SandboxRow | None = None
    error: BaseException | None = None


class Checkpoints:
    def __init__(self, instances: Instances, durable: Durability, recorder: SessionRecorder, agents: AgentClient,
                 gateway: GatewayRuns, runtime: Runtime, host_name: str) -> None:
        self.instances = instances
        self.durable = durable
        self.recorder = recorder
        self.agents = agents
        self.gateway = gateway
        self.runtime = runtime
        self.host_name = host_name

    async def take(self, row: SandboxRow, kind: str, agent_answers: bool = True) -> Manifest:
        """Checkpoint the row's instance. A pause freezes it first and leaves it frozen (its standby); any failure
        thaws it, so it runs on from where it was. `agent_answers`: False for an agent known not to answer (a
        guest-health pause): it is not asked for its journal or its ports."""
        session = row.session_id
        parent_id = row.settings.checkpoint_id
        checkpoint_id = new_checkpoint_id()
        self.agents.wake(row.sandbox_id)  # frozen while idle: thawed for the journal's last pull and the capture
        ref = await self.recorder.checkpoint_begin(session, checkpoint_id, parent_id, kind, pull=agent_answers)
        pausing = kind == "pause"
        handle = handle_of(row)
        frozen = False
        listening = await self._listening(row) if agent_answers else None
        try:
            async with self.agents.quiesce(row.sandbox_id, hold=not pausing, address=row.address):
                frozen_from = time.time()
                if pausing:  # nothing runs after the state it saves
                    await asyncio.to_thread(self.runtime.freeze, handle)
                    frozen = True
                image = await asyncio.to_thread(self.durable.capture, row)
                frozen_until = time.time()
                started = time.monotonic()
                if pausing:  # no call into the frozen sandbox until it is published
                    manifest = await self._ingest(row, image, kind, parent_id, ref, checkpoint_id,
                                                  listening=listening)
            if not pausing:
                manifest = await self._ingest(row, image, kind, parent_id, ref, checkpoint_id, listening=listening)
        except BaseException as exc:
            if isinstance(exc, Exception):
                await self.recorder.checkpoint_failed(session, checkpoint_id, str(exc))
            if frozen:
                try:
                    await asyncio.to_thread(self.runtime.thaw, handle)
                except RuntimeFailure as thaw_exc:
                    log.error("sandbox %s stays frozen after a failed pause: %s", row.sandbox_id, thaw_exc)
            raise
        await self.recorder.checkpoint_published(session, checkpoint_id, parent_id, kind, ref)
        log.info("checkpoint %s of %s (%s): paused %.0f ms, ingest %.0f ms", checkpoint_id, row.sandbox_id, kind,
                 (frozen_until - frozen_from) * 1000, (time.monotonic() - started) * 1000)
        await self.gateway.mark_checkpoint(row, checkpoint_id, frozen_from, frozen_until)
        return manifest

    async def _ingest(self, row: SandboxRow, image: Path, kind: str, parent_id: str | None, ref: EventRef | None,
                      checkpoint_id: str, memory: bool = True, listening: list[int] | None = None) -> Manifest:
        return await asyncio.to_thread(self.durable.ingest, row, image, kind=kind, parent_id=parent_id,
                                       event=ref, checkpoint_id=checkpoint_id, memory=memory, listening=listening)

    async def _listening(self, row: SandboxRow) -> list[int] | None:
        """The ports a restore of this checkpoint must see accept again before it is handed out (None: unknown, the
        template's declared services are waited for instead)."""
        try:
            return await self.agents.listening(row.sandbox_id, row.address, row.access_token)
        except (TimeoutError, aiohttp.ClientError, OSError, RuntimeFailure) as exc:
            log.warning("sandbox %s did not say which ports listen (%s); a restore of its checkpoint waits for its "
                        "template's services only", row.sandbox_id, exc)
            return None

    def restored_ports(self, manifest: Manifest, built: Built) -> list[int]:
        """What a restore of `manifest` waits for besides the agent: the ports that listened when it was taken, else
        the template's declared services."""
        ports = listening_ports(manifest)
        if ports is None:
            ports = self.instances.templates.service_ports(built.name)
        return [p for p in ports if p != AGENT_PORT]

    async def take_files(self, row: SandboxRow, kind: str = "pause",
                         export: Callable[[Path], Awaitable[int]] | None = None) -> Manifest:
        """A filesystem-only pause's checkpoint: the agent's export of the sandbox's files (its processes stopped
        meanwhile, continued after), ingested as `files.tar`. The instance is left running; the caller tears it
        down once the checkpoint is published. `export`: the runtime's instead of the agent's (a reboot)."""
        session = row.session_id
        parent_id = row.settings.checkpoint_id
        checkpoint_id = new_checkpoint_id()
        self.agents.wake(row.sandbox_id)
        ref = await self.recorder.checkpoint_begin(session, checkpoint_id, parent_id, kind, pull=export is None)
        spool = self.durable.files_spool()
        started = time.monotonic()
        try:
            if export is not None:
                size = await export(spool / FILES_ARCHIVE)
            else:
                size = await self.agents.export_files(row.sandbox_id, row.address, row.access_token,
                                                      spool / FILES_ARCHIVE)
            exported = time.monotonic()
            manifest = await self._ingest(row, spool, kind, parent_id, ref, checkpoint_id, memory=False)
        except BaseException as exc:
            shutil.rmtree(spool, ignore_errors=True)
            if isinstance(exc, Exception):
                await self.recorder.checkpoint_failed(session, checkpoint_id, str(exc))
            raise
        await self.recorder.checkpoint_published(session, checkpoint_id, parent_id, kind, ref)
        log.info("filesystem checkpoint %s of %s: %d bytes exported in %.0f ms, ingest %.0f ms", checkpoint_id,
                 row.sandbox_id, size, (exported - started) * 1000, (time.monotonic() - exported) * 1000)
        return manifest

    async def files_from_memory(self, row: SandboxRow, standby: Instance | None) -> None:
        """Make a sandbox paused with memory one paused without (a reboot from files, docs/design/sandbox-disk.md):
        its paused state runs again (the standby thawed, else the checkpoint restored into a new slot, with no
        egress), the runtime exports its files (not the agent, which may be why it is rebooted), they become a
        `memory: false` checkpoint whose parent is the memory one, and that instance is torn down."""
        held: SandboxRow | None = None
        if standby is not None:
            try:
                await asyncio.to_thread(self.runtime.thaw, Handle(standby.name, standby.slot))
                held = row.with_instance(standby)
            except RuntimeFailure as exc:
                log.warning("standby of %s cannot be thawed for a reboot (%s); restoring its checkpoint",
                            row.sandbox_id, exc)
                await self.instances.reap(row.with_instance(standby), keep_row=True)
        if held is None:
            assert row.settings.checkpoint_id is not None
            built, image = await self._materialised(
                await asyncio.to_thread(self.durable.manifest, row.settings.checkpoint_id))
            try:
                async with self.instances.starts.slot():
                    handle, slot = await self.instances.restore(
                        image, built, row_limits(row), await self.instances.mounts(row.settings.volume_mounts))
            finally:
                shutil.rmtree(image, ignore_errors=True)
            assert handle.endpoint is not None
            held = row.with_instance(Instance(handle.name, slot, handle.endpoint.address))
        inside = handle_of(held)

        async def export(dest: Path) -> int:
            return await asyncio.to_thread(self.runtime.export_files, inside, dest)

        try:
            manifest = await self.take_files(held, export=export)
        finally:
            await self.instances.reap(held, keep_row=True)
        row.settings.checkpoint_id = manifest.checkpoint_id
        row.settings.files_only = True
        row.settings.envd_unresponsive = False  # a new boot, a new agent

    async def _materialised(self, manifest: Manifest) -> tuple[Built, Path]:
        """The template build a checkpoint was taken on, and its image on disk (every chunk verified)."""
        built = await asyncio.to_thread(self.durable.template_for, manifest)
        return built, await asyncio.to_thread(self.durable.materialise, manifest)

    # -- resume ------------------------------------------------------------------------------------------------
    async def thaw(self, row: SandboxRow, standby: Instance, timeout: int) -> bool:
        """Run the row on from its standby; False (the standby is gone or does not answer: it is torn down) means
        restore from the store instead. The row is changed only on success."""
        try:
            state = await asyncio.to_thread(self.runtime.state, standby.name)
            if state != "paused":
                raise RuntimeFailure(f"its instance is {state}, not frozen")
            await self.instances.open_egress(standby.slot, row.sandbox_id, row.settings.policy)
            await asyncio.to_thread(self.runtime.thaw, Handle(standby.name, standby.slot))
            await self.agents.wait_ready(row.sandbox_id, standby.address, RESTORED_AGENT_TIMEOUT)
        except (TimeoutError, RuntimeFailure, KeepStateError, OSError) as exc:
            log.warning("standby of %s cannot resume (%s); restoring its checkpoint instead", row.sandbox_id, exc)
            await self.instances.reap(row.with_instance(standby), keep_row=True)
            return False
        row.runtime_name, row.slot, row.address = standby.name, standby.slot, standby.address
        row.end_at = time.time() + timeout
        await self.gateway.rebind(row)
        return True

    async def restore(self, row: SandboxRow, timeout: int,
                      pooled: Callable[[Built, Limits], SandboxRow | None] | None = None) -> None:
        """Run the row on from its checkpoint in the store, on a new instance. A filesystem-only checkpoint takes a
        fresh boot of its template build from `pooled` when it has one (same limits, no volumes), else boots one."""
        checkpoint_id = row.settings.checkpoint_id
        if checkpoint_id is None:
            raise RuntimeFailure(f"paused sandbox {row.sandbox_id} has no checkpoint")
        manifest = await asyncio.to_thread(self.durable.manifest, checkpoint_id)
        built, image = await self._materialised(manifest)
        memory = has_memory(manifest)
        mounts = await self.instances.mounts(row.settings.volume_mounts)
        limits = row_limits(row)
        claimed = pooled(built, limits) if pooled is not None and not memory and not mounts else None
        pooled_token = claimed.access_token if claimed is not None else None  # its agent's, until our /init
        # A new instance is a start (a claimed warm one is not): from here, when the image is on this host.
        ports = self.restored_ports(manifest, built) if memory else []
        try:
            async with self.instances.starts.slot() if claimed is None else contextlib.nullcontext():
                try:
                    fresh = await self._restore_onto(row, built, image, limits, mounts, memory, claimed,
                                                     pooled_token, ports)
                except RuntimeFailure as exc:
                    if not memory:
                        raise
                    # A restored instance that does not answer, or whose ports do not listen again, is gone
                    # already (_restore_onto reaped it); another restore of the same image usually does.
                    log.warning("restore of %s from %s failed (%s); trying once more", row.sandbox_id,
                                checkpoint_id, exc)
                    fresh = await self._restore_onto(row, built, image, limits, mounts, memory, claimed,
                                                     pooled_token, ports)
        finally:
            shutil.rmtree(image, ignore_errors=True)
        row.runtime_name, row.slot, row.address = fresh.runtime_name, fresh.slot, fresh.address
        row.template_digest = built.digest
        row.end_at = time.time() + timeout
        await self.gateway.rebind(row)

    async def _restore_onto(self, row: SandboxRow, built: Built, image: Path, limits: Limits,
                            mounts: tuple[Mount, ...], memory: bool, claimed: SandboxRow | None,
                            pooled_token: str | None, ports: list[int]) -> SandboxRow:
        """The new instance of a resume from the store, its agent initialised (a cold boot with its files)."""
        checkpoint_id = row.settings.checkpoint_id
        started = time.monotonic()
        network = (row.sandbox_id, row.settings.policy)
        if memory:
            handle, slot = await self.instances.restore(image, built, limits, mounts, network)
        elif claimed is not None:
            # Its pool record goes now: a server killed from here on reaps the instance as unknown, never
            # hands it out again with these files in it.
            await self.instances.rows.delete(claimed.sandbox_id)
            handle = Handle(claimed.runtime_name, claimed.slot, Endpoint(claimed.address))
            slot = claimed.slot
            await self.instances.open_egress(slot, *network)
        else:
            handle, slot = await self.instances.boot(built, limits, mounts, network)
        assert handle.endpoint is not None
        fresh = replace(row, runtime_name=handle.name, slot=slot, address=handle.endpoint.address)
        try:
            if claimed is None:
                await self.agents.wait_ready(row.sandbox_id, fresh.address, RESTORED_AGENT_TIMEOUT)
            if memory:
                await self.instances.wait_ports(fresh, ports, RESTORED_PORTS_TIMEOUT)
            if not memory:  # a cold boot: its files, then everything /init sets for a sandbox handed out
                booted = time.monotonic()
                entries = await self.agents.apply_files(row.sandbox_id, fresh.address, image / FILES_ARCHIVE,
                                                        pooled_token)
                applied = time.monotonic()
                if claimed is None:
                    await self.instances.wait_services(fresh, built)
                await self.instances.init_agent(fresh, await self.gateway.env(fresh), previous_token=pooled_token)
                log.info("cold boot of %s from %s (%s): booted in %.0f ms, %d entries applied in %.0f ms, ready "
                         "%.0f ms later", row.sandbox_id, checkpoint_id, "pooled" if claimed else "new",
                         (booted - started) * 1000, entries, (applied - booted) * 1000,
                         (time.monotonic() - applied) * 1000)
        except BaseException:
            await self.instances.reap(fresh, keep_row=True)
            raise
        return fresh

    def paused_row(self, sandbox_id: str) -> SandboxRow | None:
        """A sandbox this server never saw, whose pause checkpoint is in the shared store."""
        manifest = self.durable.latest_for_session(sandbox_id)
        if manifest is None:
            return None
        info: dict[str, Any] = json.loads(manifest.meta.labels["sandbox"])
        settings = Settings.from_json(info["doc"])
        settings.checkpoint_id = manifest.checkpoint_id
        settings.standby = settings.retired = None
        row = SandboxRow(sandbox_id=sandbox_id, state=State.PAUSED, template_id=info["template_id"],
                         template_digest=manifest.meta.template_digest, runtime_name="", slot=-1, address="",
                         access_token=info["access_token"], started_at=float(info["started_at"]),
                         end_at=time.time(), cpu=float(info["cpu"]), memory_mb=int(info["memory_mb"]),
                         api_key_id=info.get("api_key_id"), settings=settings)
        return row

    # -- forks and creates from snapshots -----------------------------------------------------------------------
    async def spawn(self, manifest: Manifest, parent: SandboxRow, count: int, timeout: int,
                    api_key_id: str | None = None, pooled: bool = False,
                    sandbox_id: str | None = None) -> list[Spawned]:
        """Start `count` new sandboxes from one checkpoint, each with its own ID, token, address and session.
        `pooled`: for a built template's warm pool (creates.py): POOLED rows, their slots sending nothing until a
        create claims them, each restore waiting behind every user start. `sandbox_id`: the ID of the one sandbox
        (`count` 1) an idempotent create chose for it (docs/design/idempotency.md)."""
        assert sandbox_id is None or count == 1
        await self.instances.mounts(parent.settings.volume_mounts)  # its volumes must all exist still (else Refused)
        built, image = await self._materialised(manifest)

        async def one() -> SandboxRow:
            try:
                async with self.instances.starts.slot(refill=pooled):  # each child is a start of its own
                    return await self._spawn_one(manifest, parent, built, image, timeout, api_key_id, pooled,
                                                 sandbox_id)
            except Busy:
                raise
            except Exception as exc:  # one more try: a restored agent now and then fails to answer
                log.warning("restore of %s for a new sandbox failed (%r); trying once more",
                            manifest.checkpoint_id, exc)
                async with self.instances.starts.slot(refill=pooled):
                    return await self._spawn_one(manifest, parent, built, image, timeout, api_key_id, pooled,
                                                 sandbox_id)

        try:
            results = await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)
        finally:
            shutil.rmtree(image, ignore_errors=True)
        out = []
        for r in results:
            if isinstance(r, SandboxRow):
                out.append(Spawned(row=r))
            else:
                log.error("restore of %s for a new sandbox failed: %r", manifest.checkpoint_id, r)
                out.append(Spawned(error=r))
        return out

    async def _spawn_one(self, manifest: Manifest, parent: SandboxRow, built: Built, image: Path, timeout: int,
                         api_key_id: str | None, pooled: bool = False, sandbox_id: str | None = None) -> SandboxRow:
        # A fork mounts the same volumes (shared, not copied: a checkpoint holds no volume data), and starts with
        # its parent's network policy.
        child_id = sandbox_id or new_sandbox_id()
        memory = has_memory(manifest)  # a filesystem-only snapshot's children are cold boots with its files
        mounts = await self.instances.mounts(parent.settings.volume_mounts)
        network = None if pooled else (child_id, parent.settings.policy)
        handle, slot = await (self.instances.restore(image, built, row_limits(parent), mounts, network) if memory
                              else self.instances.boot(built, row_limits(parent), mounts, network))
        assert handle.endpoint is not None
        now = time.time()
        settings = replace(parent.settings, session_id=child_id, checkpoint_id=manifest.checkpoint_id,
                           forked_from=parent.sandbox_id, standby=None, retired=None,
                           traffic_token=traffic_token(parent.settings.network))
        row = SandboxRow(sandbox_id=child_id, state=State.POOLED if pooled else State.RUNNING,
                         template_id=parent.template_id,
                         template_digest=built.digest, runtime_name=handle.name, slot=slot,
                         address=handle.endpoint.address, access_token=secrets.token_hex(16), started_at=now,
                         end_at=now + timeout, cpu=parent.cpu, memory_mb=parent.memory_mb,
                         api_key_id=api_key_id or parent.api_key_id, settings=settings)
        await self.gateway.rebind(row, parent_session=parent.session_id)
        await self.instances.rows.put(row)
        try:
            await self.agents.wait_ready(child_id, row.address, RESTORED_AGENT_TIMEOUT)
            if memory:
                await self.instances.wait_ports(row, self.restored_ports(manifest, built), RESTORED_PORTS_TIMEOUT)
                await self.instances.init_agent(row, await self.gateway.env(row), previous_token=parent.access_token,
                                                fork=True)
            else:
                await self.agents.apply_files(child_id, row.address, image / FILES_ARCHIVE)
                await self.instances.wait_services(row, built)
                await self.instances.init_agent(row, await self.gateway.env(row))
        except BaseException:
            await self.instances.reap(row)
            raise
        return row
