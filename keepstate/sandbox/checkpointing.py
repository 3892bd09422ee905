"""Pause, resume, snapshot and fork: the durable half of the sandbox lifecycle.

    running --pause--> paused --connect--> running (same ID, same token)
    running --snapshot--> running (+ a snapshot usable as templateID)
    running --fork(n)--> running (+ n new sandboxes, new IDs, tokens, addresses, sessions)
    any checkpoint: quiesce connections -> runsc checkpoint (sandbox keeps running) -> ingest -> publish

A pause destroys the running sandbox only after its checkpoint is published in the store, so a
crash at any point leaves either the running sandbox (catalog: running) or the checkpoint
(catalog: paused), never neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keepstate.db.catalog import SandboxRow
from keepstate.errors import BadRequest, Conflict, KeepStateError, Unsupported
from keepstate.runtime import network
from keepstate.runtime.base import Handle, Limits, RuntimeFailure
from keepstate.store import Manifest
from keepstate.store.ids import new_checkpoint_id

from .durable import Durability

if TYPE_CHECKING:
    from .manager import SandboxManager

log = logging.getLogger("keepstate.sandbox")
MAX_FORKS = 20
RESTORED_AGENT_TIMEOUT = 20.0  # a restored agent answers within a second; waiting longer only delays a retry


class Checkpointing:
    """Mixed into SandboxManager; uses its catalog, runtime, router and recorder."""

    durable: Durability

    async def _checkpoint(self: SandboxManager, row: SandboxRow, kind: str) -> Manifest:
        session = row.doc.get("session_id", row.sandbox_id)
        parent_id = row.doc.get("checkpoint_id")
        checkpoint_id = new_checkpoint_id()
        ref = await self.recorder.checkpoint_begin(session, checkpoint_id, parent_id, kind)
        pausing = kind == "pause"
        handle = Handle(row.runtime_name, row.slot)
        frozen = False
        try:
            async with contextlib.AsyncExitStack() as journal:
                # No journal pull while the sandbox is frozen: for a pause that is until it is published.
                await journal.enter_async_context(self.recorder.journal_hold(session))
                async with self._frozen(row, hold=not pausing):
                    frozen_from = time.time()
                    if pausing:  # nothing runs after the state it saves; the frozen instance is its standby
                        await asyncio.to_thread(self.runtime.freeze, handle)
                        frozen = True
                    image = await asyncio.to_thread(self.durable.capture, row)
                    frozen_until = time.time()
                if not pausing:
                    await journal.aclose()  # it runs on
                started = time.monotonic()
                manifest = await asyncio.to_thread(self.durable.ingest, row, image, kind=kind,
                                                   parent_id=parent_id, event=ref, checkpoint_id=checkpoint_id)
        except BaseException as exc:
            if isinstance(exc, Exception):
                self.recorder.checkpoint_failed(session, checkpoint_id, str(exc))
            if frozen:  # not paused after all: it runs on from where it was frozen
                try:
                    await asyncio.to_thread(self.runtime.thaw, handle)
                except RuntimeFailure as thaw_exc:
                    log.error("sandbox %s stays frozen after a failed pause: %s", row.sandbox_id, thaw_exc)
            raise
        self.recorder.checkpoint_published(session, checkpoint_id, parent_id, kind, ref)
        log.info("checkpoint %s of %s (%s): paused %.0f ms, ingest %.0f ms", checkpoint_id, row.sandbox_id, kind,
                 (frozen_until - frozen_from) * 1000, (time.monotonic() - started) * 1000)
        if self.gateway is not None and row.doc.get("gatewayToken"):
            try:
                self.gateway.mark_checkpoint(session, checkpoint_id, frozen_from, frozen_until)
            except LookupError as exc:  # no active run: nothing to mark, say so
                log.warning("gateway mark for checkpoint %s: %s", checkpoint_id, exc)
        return manifest

    @contextlib.asynccontextmanager
    async def _frozen(self: SandboxManager, row: SandboxRow, hold: bool) -> AsyncIterator[None]:
        """Inside the block no host connection into the sandbox is open: a TCP connection established in
        gVisor's netstack when it is checkpointed wedges the agent after a restore (runsc 20240729).

        Clients' requests are cut (hold=True: new ones wait for the block's end) and metrics are not sampled (the
        caller holds journal pulls); then the sandbox's netstack gets a moment to see the closes.
        """
        sandbox_id = row.sandbox_id
        self._freezing.add(sandbox_id)
        try:
            await self._agent_calls_done(sandbox_id)
            if self.router is not None:
                await self.router.quiesce(sandbox_id, hold=hold)
            try:
                await asyncio.sleep(0.05)
                yield
            finally:
                if self.router is not None and hold:
                    self.router.release(sandbox_id)
        finally:
            self._freezing.discard(sandbox_id)

    async def pause(self: SandboxManager, sandbox_id: str, memory: bool = True) -> str:
        if not memory:
            raise Unsupported("a filesystem-only pause (memory: false) is not supported by the gVisor runtime: "
                              "its root filesystem lives in the sandbox's memory; pause with memory instead")
        row = self.get(sandbox_id)
        if row.state == "paused":
            raise Conflict(f"Error pausing sandbox - sandbox '{sandbox_id}' is already paused")
        async with self._lock(sandbox_id):
            self._pausing.add(sandbox_id)
            try:
                manifest = await self._checkpoint(row, "pause")
            except BaseException:
                self._pausing.discard(sandbox_id)
                raise
            old = replace(row)
            row.state = "paused"
            row.doc = {**row.doc, "checkpoint_id": manifest.checkpoint_id}
            standby = self.standby_seconds > 0
            if standby:
                # The instance stays frozen in exactly the checkpoint's state: resuming it soon is a thaw.
                stats = await asyncio.to_thread(self.runtime.cgroup_stats, Handle(row.runtime_name, row.slot))
                row.doc["standby"] = {"name": row.runtime_name, "slot": row.slot, "address": row.address,
                                      "since": time.time(),
                                      "mem": stats.get("mem_used") or row.memory_mb << 20}
                self.standbys[sandbox_id] = row.doc["standby"]
            else:
                # The stopped instance is torn down in the background; remember it until then, so a server
                # killed meanwhile reaps it when it starts again.
                row.doc["retired"] = {"name": row.runtime_name, "slot": row.slot}
            row.runtime_name, row.address, row.slot = "", "", -1
            self.catalog.put_sandbox(row)
            self.live.pop(sandbox_id, None)
            self._pausing.discard(sandbox_id)
            self.recorder.paused(row.doc.get("session_id", sandbox_id), manifest.checkpoint_id, True)
            if not standby:  # the checkpoint is already safe in the store
                self._in_background(self._retire(row, old))
            return manifest.checkpoint_id

    async def _retire(self: SandboxManager, row: SandboxRow, old: SandboxRow) -> None:
        await self._reap(old, keep_row=True)
        if row.doc.pop("retired", None) is not None and row.state == "paused":
            self.catalog.put_sandbox(row)

    # -- standbys: paused sandboxes kept frozen in memory for a while -------------------------------------------
    async def _thaw(self: SandboxManager, row: SandboxRow, timeout: int) -> bool:
        """Resume from the standby if it is still frozen and answers; False (standby gone) means: restore."""
        sb = row.doc.pop("standby")
        self.standbys.pop(row.sandbox_id, None)
        instance = replace(row, runtime_name=sb["name"], slot=sb["slot"], address=sb["address"])
        try:
            state = await asyncio.to_thread(self.runtime.state, sb["name"])
            if state != "paused":
                raise RuntimeFailure(f"its instance is {state}, not frozen")
            await asyncio.to_thread(self.runtime.thaw, Handle(instance.runtime_name, instance.slot))
            row.runtime_name, row.slot, row.address = instance.runtime_name, instance.slot, instance.address
            row.state = "running"
            row.end_at = time.time() + timeout
            if self.gateway is not None and row.doc.get("gatewayToken"):
                self.register_gateway_run(row)
            self.catalog.put_sandbox(row)
            await self._wait_agent(row, RESTORED_AGENT_TIMEOUT)
        except (RuntimeFailure, KeepStateError, OSError, asyncio.TimeoutError) as exc:
            log.warning("standby of %s cannot resume (%s); restoring its checkpoint instead", row.sandbox_id, exc)
            await self._reap(instance, keep_row=True)
            row.state, row.runtime_name, row.slot, row.address = "paused", "", -1, ""
            self.catalog.put_sandbox(row)
            return False
        self.live[row.sandbox_id] = row
        self.recorder.resumed(row.doc.get("session_id", row.sandbox_id), row.doc["checkpoint_id"], self.host_name,
                              agent_url=f"http://{row.address}:49983", token=row.access_token, source="standby")
        return True

    async def _release_standby(self: SandboxManager, sandbox_id: str, why: str) -> None:
        """Destroy a paused sandbox's standby; its checkpoint stays, so a resume restores from the store."""
        async with self._lock(sandbox_id):
            self.standbys.pop(sandbox_id, None)
            row = self.catalog.get_sandbox(sandbox_id)
            sb = row.doc.pop("standby", None) if row is not None and row.state == "paused" else None
            if row is None or sb is None:
                return
            log.info("releasing the standby of paused sandbox %s (%s)", sandbox_id, why)
            # Recorded as retired until it is gone, so a server killed meanwhile reaps it when it starts again.
            row.doc["retired"] = {"name": sb["name"], "slot": sb["slot"]}
            self.catalog.put_sandbox(row)
            await self._retire(row, replace(row, runtime_name=sb["name"], slot=sb["slot"]))

    async def trim_standbys(self: SandboxManager) -> None:
        """Release standbys older than standby_seconds, then the oldest until all fit in standby_mb."""
        now = time.time()
        total = sum(int(sb["mem"]) for sb in self.standbys.values())
        for sandbox_id, sb in sorted(self.standbys.items(), key=lambda kv: float(kv[1]["since"])):
            if now - float(sb["since"]) >= self.standby_seconds:
                why = f"paused for {self.standby_seconds:g} s"
            elif total > self.standby_mb << 20:
                why = f"standbys hold more than {self.standby_mb} MiB"
            else:
                continue
            total -= int(sb["mem"])
            await self._release_standby(sandbox_id, why)

    async def _resume(self: SandboxManager, row: SandboxRow, timeout: int) -> SandboxRow:
        if row.doc.get("standby") is not None and await self._thaw(row, timeout):
            return row
        checkpoint_id = row.doc["checkpoint_id"]
        manifest = await asyncio.to_thread(self.durable.manifest, checkpoint_id)
        built = await asyncio.to_thread(self.durable.template_for, manifest)
        image = await asyncio.to_thread(self.durable.materialise, manifest)
        slot = self._alloc_slot()
        try:
            handle = await asyncio.to_thread(self.durable.restore, image, built,
                                             Limits(cpu=row.cpu, memory_mb=row.memory_mb), slot)
        except BaseException:
            self._release_slot(slot)
            raise
        assert handle.endpoint is not None
        row.runtime_name, row.slot, row.address = handle.name, slot, handle.endpoint.address
        network.record_slot_owner(slot, str(self.catalog.path.parent), handle.name)
        row.template_digest = built.digest
        row.state = "running"
        row.end_at = time.time() + timeout
        if self.gateway is not None and row.doc.get("gatewayToken"):
            # Bind the new address before the restored agent can call the gateway.
            self.register_gateway_run(row)
        self.catalog.put_sandbox(row)
        try:
            await self._wait_agent(row, RESTORED_AGENT_TIMEOUT)
        except BaseException:
            await self._reap(row, keep_row=True)
            row.state, row.runtime_name, row.slot = "paused", "", -1
            self.catalog.put_sandbox(row)
            raise
        self.live[row.sandbox_id] = row
        self.recorder.resumed(row.doc.get("session_id", row.sandbox_id), checkpoint_id, self.host_name,
                              agent_url=f"http://{row.address}:49983", token=row.access_token)
        return row

    def _row_from_store(self: SandboxManager, sandbox_id: str) -> SandboxRow | None:
        """A sandbox this server never saw, whose pause checkpoint is in the shared store."""
        manifest = self.durable.latest_for_session(sandbox_id)
        if manifest is None:
            return None
        info: dict[str, Any] = json.loads(manifest.meta.labels["sandbox"])
        doc = dict(info["doc"])
        doc["checkpoint_id"] = manifest.checkpoint_id
        row = SandboxRow(sandbox_id=sandbox_id, state="paused", template_id=info["template_id"],
                         template_digest=manifest.meta.template_digest, runtime_name="", slot=-1, address="",
                         access_token=info["access_token"], started_at=float(info["started_at"]),
                         end_at=time.time(), cpu=float(info["cpu"]), memory_mb=int(info["memory_mb"]),
                         api_key_id=info.get("api_key_id"), doc=doc)
        self.catalog.put_sandbox(row)
        if self.recorder.lineage.session(doc.get("session_id", sandbox_id)) is None:
            self.recorder.lineage.record_session(doc.get("session_id", sandbox_id), row.template_id)
        return row

    async def snapshot(self: SandboxManager, sandbox_id: str, name: str | None) -> dict[str, Any]:
        row = self.get(sandbox_id)
        if row.state != "running":
            raise Conflict(f"sandbox '{sandbox_id}' is {row.state}; snapshots are taken of running sandboxes")
        if name is not None and (not isinstance(name, str) or not name.strip() or len(name) > 128):
            raise BadRequest("`name` must be a non-empty string of at most 128 characters")
        async with self._lock(sandbox_id):
            manifest = await self._checkpoint(row, "snapshot")
        snapshot_id = f"snapshot-{manifest.checkpoint_id.lower()}"
        names = [name.strip()] if name else [snapshot_id]
        self.catalog.put_snapshot(snapshot_id, names, manifest.checkpoint_id, sandbox_id, row.template_id)
        return {"snapshotID": snapshot_id, "names": names}

    def find_snapshot(self: SandboxManager, ref: str) -> dict[str, Any] | None:
        snap = self.catalog.get_snapshot(ref)
        if snap is not None:
            return snap
        for s in self.catalog.snapshots():
            if ref in s["names"] or ref.split(":")[0] in s["names"]:
                return s
        return None

    async def fork(self: SandboxManager, sandbox_id: str, count: int, timeout: int) -> list[dict[str, Any]]:
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORKS:
            raise BadRequest(f"`count` must be a whole number from 1 to {MAX_FORKS}")
        row = self.get(sandbox_id)
        if row.state != "running":
            raise Conflict(f"sandbox '{sandbox_id}' is {row.state}; only running sandboxes can be forked")
        async with self._lock(sandbox_id):
            manifest = await self._checkpoint(row, "fork")
        return await self.spawn_from(manifest, row, count, timeout)

    async def spawn_from(self: SandboxManager, manifest: Manifest, parent: SandboxRow, count: int,
                         timeout: int, api_key_id: str | None = None) -> list[dict[str, Any]]:
        """Start `count` new sandboxes from one checkpoint; each result is a row or an error."""
        built = await asyncio.to_thread(self.durable.template_for, manifest)
        image = await asyncio.to_thread(self.durable.materialise, manifest)
        async def one() -> SandboxRow:
            try:
                return await self._spawn_one(manifest, parent, built, image, timeout, api_key_id)
            except Exception as exc:  # one more try: a restored agent now and then fails to answer
                log.warning("restore of %s for a new sandbox failed (%r); trying once more",
                            manifest.checkpoint_id, exc)
                return await self._spawn_one(manifest, parent, built, image, timeout, api_key_id)

        try:
            results = await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    log.error("restore of %s for a new sandbox failed: %r", manifest.checkpoint_id, r)
        finally:
            shutil.rmtree(image, ignore_errors=True)
        return [{"row": r} if isinstance(r, SandboxRow) else {"error": r} for r in results]

    async def _spawn_one(self: SandboxManager, manifest: Manifest, parent: SandboxRow, built: Any, image: Path,
                         timeout: int, api_key_id: str | None) -> SandboxRow:
        slot = self._alloc_slot()
        try:
            handle = await asyncio.to_thread(self.durable.restore, image, built,
                                             Limits(cpu=parent.cpu, memory_mb=parent.memory_mb), slot, True)
        except BaseException:
            self._release_slot(slot)
            raise
        now = time.time()
        from .manager import new_sandbox_id

        assert handle.endpoint is not None
        child_id = new_sandbox_id()
        row = SandboxRow(sandbox_id=child_id, state="running", template_id=parent.template_id,
                         template_digest=built.digest, runtime_name=handle.name, slot=slot,
                         address=handle.endpoint.address, access_token=secrets.token_hex(16), started_at=now,
                         end_at=now + timeout, cpu=parent.cpu, memory_mb=parent.memory_mb,
                         api_key_id=api_key_id or parent.api_key_id,
                         doc={**parent.doc, "session_id": child_id, "checkpoint_id": manifest.checkpoint_id,
                              "forked_from": parent.sandbox_id})
        parent_session = parent.doc.get("session_id", parent.sandbox_id)
        if self.gateway is not None and parent.doc.get("gatewayToken"):
            self.register_gateway_run(row, parent_session=parent_session)
        self.catalog.put_sandbox(row)
        network.record_slot_owner(slot, str(self.catalog.path.parent), handle.name)
        try:
            await self._wait_agent(row, RESTORED_AGENT_TIMEOUT)
            await self._init_agent(row, self._sandbox_env(row), row.doc.get("user", "user"),
                                   row.doc.get("workdir", "/home/user"), previous_token=parent.access_token,
                                   fork=True)
        except BaseException:
            await self._reap(row)
            raise
        self.live[child_id] = row
        self.recorder.forked(parent_session, child_id, manifest.checkpoint_id,
                             agent_url=f"http://{row.address}:49983", token=row.access_token)
        return row

    async def kill_paused(self: SandboxManager, row: SandboxRow) -> None:
        await self._release_standby(row.sandbox_id, "killed")
        self.catalog.delete_sandbox(row.sandbox_id)
        self.recorder.killed(row.doc.get("session_id", row.sandbox_id), "kill")

    def _lock(self: SandboxManager, sandbox_id: str) -> asyncio.Lock:
        lock = self._locks.get(sandbox_id)
        if lock is None:
            lock = self._locks[sandbox_id] = asyncio.Lock()
        return lock
