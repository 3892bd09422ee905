"""Runtime instances: starting one (cold, for a pool or a create), restoring one from an image, initialising its
agent, and tearing one down. No lifecycle decisions here: the manager makes them under the sandbox's lock.

Every instance is recorded in the catalog before it exists, so a crash in between leaves a row to reap, never a
stray sandbox; its slot records the instance's name host-wide.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from keepstate.egress.policy import Policy
from keepstate.egress.service import Egress
from keepstate.runtime.base import Handle, Limits, Mount, Runtime, RuntimeFailure, SandboxSpec, TemplateRoot
from keepstate.template.builder import Built
from keepstate.volume import Volumes

from .admission import StartQueue
from .agent_client import SETTLE, AgentClient, agent_url
from .boot_images import BootImages
from .record import SandboxRow, TeardownRecord
from .rows import SandboxRows
from .slots import Slots
from .state import State
from .teardowns import Teardowns
from .templates import Templates

log = logging.getLogger("keepstate.sandbox")

AGENT_READY_TIMEOUT = 60.0
RESTORED_AGENT_TIMEOUT = 20.0  # a restored agent answers within a second; waiting longer only delays a retry
SERVICE_READY_TIMEOUT = 180.0
# A restored (forked, resumed) instance's ports listened when its checkpoint was taken: they accept within
# milliseconds of the agent unless the restore lost one, and then waiting longer does not bring it back.
RESTORED_PORTS_TIMEOUT = 10.0


def handle_of(row: SandboxRow) -> Handle:
    return Handle(row.runtime_name, row.slot)


def new_runtime_name() -> str:
    return "ks-" + secrets.token_hex(8)


class Instances:
    def __init__(self, rows: SandboxRows, runtime: Runtime, slots: Slots, agents: AgentClient,
                 templates: Templates, starts: StartQueue, volumes: Volumes | None = None,
                 boot_images: BootImages | None = None, egress: Egress | None = None) -> None:
        self.rows = rows
        self.egress = egress
        self.starts = starts  # every start holds one of its slots: here (start), or its caller (boot, restore)
        self.boot_images = boot_images
        self.volumes = volumes
        self.runtime = runtime
        self.slots = slots
        self.agents = agents
        self.templates = templates
        self.teardowns = Teardowns(rows, runtime, slots)
        self._background: set[asyncio.Task[None]] = set()

    def spec(self, built: Built, limits: Limits, name: str | None = None,
             mounts: tuple[Mount, ...] = ()) -> SandboxSpec:
        return SandboxSpec(name=name or new_runtime_name(), template=TemplateRoot(built.name, built.digest,
                                                                                   built.rootfs), limits=limits,
                           mounts=mounts)

    async def mounts(self, volume_mounts: list[dict[str, str]]) -> tuple[Mount, ...]:
        """The bind mounts of a sandbox's volumes (Settings.volume_mounts); Refused when one is gone."""
        if not volume_mounts:
            return ()
        if self.volumes is None:
            raise RuntimeFailure("this server has no volume store, yet a sandbox mounts volumes")
        return tuple([Mount(await self.volumes.source(m["volume_id"], m["name"]), m["path"]) for m in volume_mounts])

    async def start(self, built: Built, limits: Limits, mounts: tuple[Mount, ...] = (),
                    refill: bool = False) -> SandboxRow:
        """A new instance of a template build, agent answering and services listening, as a POOLED row; under a
        start slot (a pool's refill waits behind every user start; a user start may be refused: Busy). Restored
        from the build's boot image when it has one (boot_images.py), else booted (and, if it has none yet,
        captured as the image)."""
        async with self.starts.slot(refill):
            key = None
            if self.boot_images is not None and not mounts and not self.templates.service_ports(built.name):
                key = self.boot_images.key(built.digest, limits)
                image = self.boot_images.image(key)
                if image is not None:
                    try:
                        return await self._start(built, limits, mounts, image)
                    except RuntimeFailure as exc:
                        self.boot_images.discard(key, f"a restore from it failed: {exc}")
            row = await self._start(built, limits, mounts, None)
            if key is not None and self.boot_images is not None and self.boot_images.wanted(key):
                await asyncio.sleep(SETTLE)  # wait_ready's connection is closed: let the netstack see it
                await self.boot_images.capture(key, handle_of(row))
            return row

    async def _start(self, built: Built, limits: Limits, mounts: tuple[Mount, ...],
                     image: Path | None) -> SandboxRow:
        slot = self.slots.alloc()
        spec = self.spec(built, limits, mounts=mounts)
        now = time.time()
        row = SandboxRow(sandbox_id=spec.name, state=State.POOLED, template_id=built.name,
                         template_digest=built.digest, runtime_name=spec.name, slot=slot, address="",
                         access_token="", started_at=now, end_at=now, cpu=limits.cpu, memory_mb=limits.memory_mb)
        row.settings.from_image = image is not None
        await self.rows.put(row)
        self.slots.bind(slot, spec.name)
        try:
            await self.close_egress(slot)  # a pooled sandbox sends nothing until a create claims it
            if image is None:
                handle = await asyncio.to_thread(self.runtime.create, spec, slot)
            else:
                handle = await asyncio.to_thread(self.runtime.restore, spec, image, slot)
            assert handle.endpoint is not None
            row.address = handle.endpoint.address
            await self.rows.put(row)
            await self.agents.wait_ready(row.sandbox_id, row.address,
                                         AGENT_READY_TIMEOUT if image is None else RESTORED_AGENT_TIMEOUT)
            await self.wait_services(row, built)
        except BaseException:
            await self.reap(row)
            raise
        return row

    async def boot(self, built: Built, limits: Limits, mounts: tuple[Mount, ...] = (),
                   network: tuple[str, Policy] | None = None) -> tuple[Handle, int]:
        """A new instance of a template build, cold (a filesystem-only resume), its slot bound to it; the caller
        holds a start slot, waits for its agent and gives it its /init. `network`: (sandbox ID, policy) whose
        egress the slot gets before the instance runs."""
        return await self._on_new_slot(built, limits, mounts, self.runtime.create, network)

    async def restore(self, image: Path, built: Built, limits: Limits, mounts: tuple[Mount, ...] = (),
                      network: tuple[str, Policy] | None = None) -> tuple[Handle, int]:
        """A new instance from a materialised image (which stays: forks share one); its slot bound to it. `mounts`
        must be those the checkpointed instance had (its volumes). The caller holds a start slot."""
        return await self._on_new_slot(built, limits, mounts,
                                       lambda spec, slot: self.runtime.restore(spec, image, slot), network)

    async def _on_new_slot(self, built: Built, limits: Limits, mounts: tuple[Mount, ...],
                           start: Callable[[SandboxSpec, int], Handle],
                           network: tuple[str, Policy] | None = None) -> tuple[Handle, int]:
        slot = self.slots.alloc()
        spec = self.spec(built, limits, mounts=mounts)
        try:
            self.slots.bind(slot, spec.name)
            if network is None:
                await self.close_egress(slot)
            else:  # before it runs: a restored sandbox's first packets already meet its policy
                await self.open_egress(slot, *network)
            handle = await asyncio.to_thread(start, spec, slot)
        except BaseException:
            await self.teardowns.later(spec.name, slot)  # whatever the failed start left; the slot is released then
            raise
        return handle, slot

    async def wait_services(self, row: SandboxRow, built: Built) -> None:
        """A sandbox is handed out only once its template's services (e.g. the code interpreter) listen."""
        await self.wait_ports(row, self.templates.service_ports(built.name), SERVICE_READY_TIMEOUT)

    async def wait_ports(self, row: SandboxRow, ports: list[int], timeout: float) -> None:
        """Until each of `ports` accepts a connection from the host; RuntimeFailure, naming the template's service
        on that port if it has one, after `timeout` seconds. Each probe connection is closed at once."""
        deadline = time.monotonic() + timeout
        for port in ports:
            while True:
                try:
                    async with asyncio.timeout(2):  # not wait_for: 3.11's can lose a cancellation (gh-86296)
                        _, writer = await asyncio.open_connection(row.address, port)
                    writer.close()
                    await writer.wait_closed()
                    break
                except (TimeoutError, OSError):
                    if time.monotonic() > deadline:
                        raise RuntimeFailure(f"{self.describe_port(row.template_id, port)} of {row.sandbox_id} "
                                             f"did not accept connections within {timeout:.0f}s") from None
                    await asyncio.sleep(0.1)

    def describe_port(self, template: str, port: int) -> str:
        """'service code-interpreter (port 49999)' for a template's service, 'port 8000' for any other."""
        name = self.templates.service_names(template).get(port)
        return f"service {name} (port {port})" if name else f"port {port}"

    # -- egress (egress/service.py) ------------------------------------------------------------------------------
    async def open_egress(self, slot: int, sandbox_id: str, policy: Policy) -> None:
        if self.egress is not None:
            await asyncio.to_thread(self.egress.attach, slot, sandbox_id, policy)

    async def attach(self, row: SandboxRow) -> None:
        """Give the row's slot its sandbox's policy (a claimed warm sandbox, a thawed standby, an adopted one)."""
        await self.open_egress(row.slot, row.sandbox_id, row.settings.policy)

    async def close_egress(self, slot: int) -> None:
        """A slot freshly ours: whatever an earlier owner (a dead server's sandbox) left on it goes."""
        if self.egress is not None:
            await asyncio.to_thread(self.egress.detach, slot)

    async def init_agent(self, row: SandboxRow, env: dict[str, str], previous_token: str | None = None,
                         fork: bool = False) -> None:
        s = row.settings
        body: dict[str, Any] = {
            "accessToken": row.access_token, "envVars": env, "defaultUser": s.user, "defaultWorkdir": s.workdir,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "sandboxId": row.sandbox_id, "sessionId": row.session_id,
        }
        network = self.egress.init_body() if self.egress is not None else None
        if network is not None:
            body["network"] = network
        if fork:
            body["fork"] = {"parent": s.forked_from, "checkpointId": s.checkpoint_id}
        await self.agents.init(row.sandbox_id, row.address, body, previous_token)

    def url(self, row: SandboxRow) -> str:
        return agent_url(row.address)

    # -- teardown -----------------------------------------------------------------------------------------------
    async def reap(self, row: SandboxRow, catalog_id: str | None = None, keep_row: bool = False) -> None:
        """Tear the row's instance down (teardowns.py: recorded first, retried until nothing is left, its slot
        released then); drop its catalog row unless keep_row. Returns after the first attempt."""
        if await self.reap_later(row, catalog_id, keep_row):
            await self.teardowns.attempt(row.runtime_name)

    async def reap_later(self, row: SandboxRow, catalog_id: str | None = None, keep_row: bool = False) -> bool:
        """As reap, leaving the teardown to the retry loop (due at once): adoption reaps many rows and waits for none.
        Whether there is a teardown."""
        slot = row.slot
        if slot >= 0 and not self.slots.ours(slot, row.runtime_name):
            slot = -1
        if slot >= 0 and self.egress is not None:
            try:
                self.egress.detach(slot, row.sandbox_id)
            except OSError as exc:  # the next owner of the slot closes it anew (close_egress)
                log.warning("closing the egress of slot %d: %s", slot, exc)
        if not keep_row:  # the row goes in the transaction that records its teardown: one of them survives a crash
            teardown = (TeardownRecord(runtime_name=row.runtime_name, slot=slot, next_try=time.time())
                        if row.runtime_name else None)
            await self.rows.delete(catalog_id or row.sandbox_id, teardown)
        if row.runtime_name:
            await self.teardowns.later(row.runtime_name, slot, recorded=not keep_row)
        if not row.runtime_name and slot >= 0:
            self.slots.release(slot)
        return bool(row.runtime_name)

    def in_background(self, teardown: Coroutine[Any, Any, None]) -> None:
        """Run work after the caller has answered (a teardown; a fenced node's hold: app.py); drain() waits for every
        one of them."""
        task = asyncio.get_running_loop().create_task(teardown, name=getattr(teardown, "__qualname__", None))
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[None]) -> None:
        """Forget a finished background job; what it raised is logged here (nobody awaits it)."""
        self._background.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("background work %s failed: %r (its sandbox's teardown, if any, is retried from the "
                        "database at the next start)", task.get_name(), exc)

    async def drain(self) -> None:
        await asyncio.gather(*self._background, return_exceptions=True)
