"""Adoption: what a server starting (after a clean stop, a crash or SIGKILL) does with every sandbox in its
catalog, by state (state.ADOPTION), given what the runtime still runs.

Orphans first: instances whose data directory is gone can never be adopted by anyone, so they are reaped.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from keepstate.errors import KeepStateError
from keepstate.runtime.base import RuntimeFailure

from .instances import handle_of
from .state import AFTER_CRASH, State

if TYPE_CHECKING:
    from .manager import SandboxManager

log = logging.getLogger("keepstate.sandbox")


async def sweep_orphans(m: SandboxManager) -> None:
    """Reap sandboxes whose server's data directory was deleted (nobody can ever adopt them)."""
    for slot, name in await asyncio.to_thread(m.slots.orphaned):
        log.warning("reaping orphaned sandbox %s (its data directory is gone)", name)
        await m.instances.teardowns.later(name, slot)


async def adopt(m: SandboxManager) -> None:
    await m.instances.teardowns.resume()  # first: their slots stay held, and no sweep below takes them for unknown
    await sweep_orphans(m)
    rows = await m.rows.list()
    statuses = await asyncio.to_thread(m.runtime.statuses)
    # unknown: its state could not be read; never reap on a failed read
    alive = {name for name, status in statuses.items() if status in ("running", "unknown")}
    frozen = {name for name, status in statuses.items() if status == "paused"}
    latest: dict[str, str | None] = {}
    for row in rows:
        if row.template_id not in latest:
            try:
                b = await asyncio.to_thread(m.templates.latest, row.template_id)
            except KeepStateError:
                b = None
            latest[row.template_id] = b.digest if b else None
    for row in rows:
        row.state = AFTER_CRASH.get(row.state, row.state)
        s = row.settings
        if s.standby is not None and row.state == State.PAUSED:
            if s.standby.name in frozen:
                m.standbys.add(row.sandbox_id, s.standby)
                m.slots.adopt(s.standby.slot)
                log.info("adopted the standby of paused sandbox %s", row.sandbox_id)
            else:  # the host restarted or someone removed it: the checkpoint remains
                s.retired, s.standby = s.standby, None
        if s.retired is not None:  # an instance stopped by a pause whose teardown a crash interrupted
            await m.instances.reap_later(row.with_instance(s.retired), keep_row=True)
            s.retired = None
        if row.state == State.PAUSED:
            row.runtime_name, row.slot, row.address = "", -1, ""
            await m.rows.put(row)
            m.table.enter(row)
            continue
        m.slots.adopt(row.slot)
        if row.state == State.RUNNING and row.runtime_name in frozen:
            # A pause froze it, then the server died before the checkpoint was published: it runs on.
            try:
                await asyncio.to_thread(m.runtime.thaw, handle_of(row))
                alive.add(row.runtime_name)
                log.warning("sandbox %s was frozen by an unfinished pause; thawed it", row.sandbox_id)
            except RuntimeFailure as exc:
                log.error("sandbox %s was frozen by an unfinished pause and cannot be thawed: %s",
                          row.sandbox_id, exc)
        # A built template's pooled restore (creates.py) is not kept: the next create of it refills its pool.
        stale_pool = row.state == State.POOLED and (latest.get(row.template_id) != row.template_digest
                                                    or row.settings.checkpoint_id is not None)
        if row.state in (State.RUNNING, State.POOLED) and row.runtime_name in alive and not stale_pool:
            # A server that stopped (or died) with it frozen while idle: it runs again; this server's freezer
            # freezes it anew once it is idle.
            await asyncio.to_thread(m.runtime.idle_thaw, handle_of(row))
            await m.rows.put(row)
            if row.state == State.RUNNING:
                m.table.enter(row)
                try:  # this server's resolver and proxy listen on new ports: the slot's rules name them anew
                    await m.instances.attach(row)
                except OSError as exc:
                    log.error("sandbox %s: its egress cannot be re-attached: %s", row.sandbox_id, exc)
            else:
                built = await asyncio.to_thread(m.templates.latest, row.template_id)
                if built is not None:
                    m.pool(built).adopt(row)
            log.info("adopted %s sandbox %s", row.state, row.sandbox_id)
        else:
            log.warning("sandbox %s (%s) is gone or stale; reaping", row.sandbox_id, row.state)
            await m.instances.reap_later(row)
    await sweep_unknown(m)


async def sweep_unknown(m: SandboxManager) -> None:
    """Reap instances recorded in the slot table for this data directory that no row knows: started by a command
    the crash interrupted before its row named them (a resume's or a fork's restore)."""
    known = {name for p in m.pools.values() for name in p.names()} | m.instances.teardowns.names()
    for row in await m.rows.list():
        known.add(row.runtime_name)
        for inst in (row.settings.standby, row.settings.retired):
            if inst is not None:
                known.add(inst.name)
    for slot, name in await asyncio.to_thread(m.slots.owned):
        if name not in known:
            log.warning("reaping instance %s in slot %d: no sandbox of this server knows it", name, slot)
            await m.instances.teardowns.later(name, slot)
