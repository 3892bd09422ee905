"""Paused retention, as an operator sets it (docs/design/cluster.md, "Lifetimes and retention").

With `serve --paused-retention D`, a sandbox paused for longer than D (by the database's clock: `sandboxes.paused_at`,
kept by the repository) is deleted as a kill of a paused sandbox deletes it (its history records `sandbox.kill` with
the reason `retention`), and its pause checkpoints are unpublished; the store's garbage collection then reclaims their
chunks, so that paused memory holding secrets does not live forever.

    retention = Retention(manager, retention=7 * 86400)
    retention.start()            # a round every RETENTION_EVERY seconds on every node
    await retention.round()      # one round now: the sandboxes it deleted

- **Who deletes.** Every node, for its own paused sandboxes (it holds them: the command runs under its table's lock,
  as a kill does, and tears down its standby), and for those of nodes that are gone, which it takes over first as a
  connect would (their epoch moves on). The sandbox's pause checkpoints are unpublished under the same lock, so a
  connect racing the deletion finds neither a row nor a checkpoint to load it back from: a 404. Only `pause`
  checkpoints go: a snapshot's, a fork's or a template's are named by others.
- **Who collects.** One node at a time across the cluster: the one holding the `store-gc` lease in the database
  (`keepstate.db.repos.Leases`), renewed while the collection runs in a thread. A node collects when it unpublished
  something; one that cannot get the lease, or whose collection the store refuses (a writer holds its shared lock),
  tries again at its next round. Any later collection reclaims what one stopped half-way left. The store's own
  exclusive lock (checkpoint-format.md, D2) still guards it against a `keepstate store gc` run by hand, and keeps
  pauses and resumes out while it runs (they fail then: collections run only when something was deleted).

Without `--paused-retention` nothing here runs: paused sandboxes are kept, and no collection runs by itself
(`keepstate store gc` is the operator's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

from keepstate.db.repos import Leases, Sandboxes
from keepstate.errors import Conflict, KeepStateError
from keepstate.store import StoreError
from keepstate.store.errors import CheckpointNotFound
from keepstate.store.gc import GcReport

from .record import SandboxRow
from .state import Command, State

if TYPE_CHECKING:
    from .manager import SandboxManager

log = logging.getLogger("keepstate.sandbox.retention")

RETENTION_EVERY = 60.0  # seconds between rounds
GC_LEASE = "store-gc"  # the lease one node at a time collects the store under
GC_LEASE_TTL = 60.0  # seconds; renewed every third of it while a collection runs
UNPUBLISHED_KINDS = ("pause", "policy")  # the checkpoints of a deleted sandbox's session no one else names


class _NotDue(Conflict):
    """Resumed (and maybe paused again) since it was found past its retention: kept."""


class Retention:
    def __init__(self, m: SandboxManager, retention: float | None, every: float = RETENTION_EVERY,
                 lease_ttl: float = GC_LEASE_TTL) -> None:
        self.m = m
        self.retention = retention  # seconds a sandbox stays paused; None: forever (nothing here runs)
        self.every = every
        self.lease_ttl = lease_ttl
        self.serving: Callable[[], bool] = lambda: True  # whether this node may act now (not fenced)
        self.leases = Leases(m.db)
        self.sandboxes = Sandboxes(m.db)
        self.holder = f"{m.rows.node_id}/{secrets.token_hex(6)}"  # this process: a restarted node is another holder
        self.collect_store: Callable[[], GcReport] = lambda: m.durable.repo.gc()  # run in a thread
        self.gc_due = False  # checkpoints were unpublished, and await a collection
        self.unpublish_later: list[str] = []  # checkpoints of deleted sandboxes the store refused to unpublish
        self.last_gc: GcReport | None = None
        self._round = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    # -- the loop -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.retention is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="paused-retention")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every)  # first: the start (adoption, pools' restores) has the store to itself
            if not self.serving():  # a fenced node deletes nothing (sandbox/fencing.py)
                continue
            try:
                await self.round()
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                log.warning("paused retention: %s", exc)

    async def round(self) -> list[str]:
        """Delete the paused sandboxes past their retention, then collect the store if anything was unpublished (now
        or by an earlier round whose collection could not run): the sandboxes deleted."""
        if self.retention is None:
            return []
        async with self._round:
            if self.unpublish_later:
                await asyncio.to_thread(self._unpublish, self.unpublish_later)
            deleted = await self.expire(self.retention)
            if self.gc_due:
                await self.collect()
            return deleted

    # -- deleting -------------------------------------------------------------------------------------------------
    async def expire(self, retention: float) -> list[str]:
        """Delete this node's (and gone nodes') sandboxes paused for more than `retention` seconds."""
        due = await self.sandboxes.paused_longer_than(retention, self.m.rows.node_id)
        if not due:
            return []
        checkpoints = await asyncio.to_thread(self._checkpoints_by_session)
        deleted = []
        for sandbox_id in due:
            try:
                await self._expire_one(sandbox_id, retention, checkpoints)
            except KeepStateError as exc:  # resumed, killed or taken meanwhile: it is not ours to delete now
                log.info("paused retention keeps sandbox %s: %s", sandbox_id, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - the others are still due
                log.warning("paused retention could not delete sandbox %s: %r", sandbox_id, exc)
                continue
            deleted.append(sandbox_id)
        return deleted

    async def _expire_one(self, sandbox_id: str, retention: float, checkpoints: dict[str, list[str]]) -> None:
        m = self.m
        if sandbox_id not in m.table:
            await m._known(sandbox_id)  # a gone node's: taken over first, as a connect would (its epoch moves on)

        async def still_due(row: SandboxRow) -> None:
            if row.state != State.PAUSED or not await self.sandboxes.paused_longer_than(
                    retention, m.rows.node_id, sandbox_id):
                raise _NotDue(f"sandbox {sandbox_id} was resumed since")

        async with m.table.command(sandbox_id, Command.KILL, admit=still_due) as step:
            session = step.row.session_id
            log.info("sandbox %s has been paused for more than %s s (--paused-retention): deleting it and its "
                     "pause checkpoints", sandbox_id, f"{retention:g}")
            await m._kill_paused(step, "retention")
            # Still under its lock: a connect waiting for it then finds no checkpoint to load it back from either.
            await asyncio.to_thread(self._unpublish, checkpoints.get(session, []))

    def _checkpoints_by_session(self) -> dict[str, list[str]]:
        """The store's checkpoints of UNPUBLISHED_KINDS, by session."""
        out: dict[str, list[str]] = {}
        for manifest in self.m.durable.repo.list_checkpoints():
            if manifest.meta.labels.get("kind") in UNPUBLISHED_KINDS:
                out.setdefault(manifest.meta.session_id, []).append(manifest.checkpoint_id)
        return out

    def _unpublish(self, checkpoint_ids: list[str]) -> None:
        """Remove the checkpoints' refs (their data is the next collection's); one the store refuses now is tried
        again at the next round (its sandbox is deleted already)."""
        failed = []
        for checkpoint_id in list(checkpoint_ids):
            try:
                self.m.durable.repo.delete_checkpoint(checkpoint_id)
            except CheckpointNotFound:
                continue
            except (StoreError, OSError) as exc:
                log.warning("unpublishing checkpoint %s of a deleted sandbox: %s; trying again next round",
                            checkpoint_id, exc)
                failed.append(checkpoint_id)
                continue
            self.gc_due = True
        self.unpublish_later = [c for c in self.unpublish_later if c not in checkpoint_ids] + failed

    # -- collecting -----------------------------------------------------------------------------------------------
    async def collect(self) -> GcReport | None:
        """Collect the store's garbage under the `store-gc` lease: the report, or None if another node holds the
        lease or the store refused (tried again at the next round)."""
        token = await self.leases.acquire(GC_LEASE, self.holder, self.lease_ttl)
        if token is None:
            log.info("store gc waits: another node holds the %s lease", GC_LEASE)
            return None
        work = asyncio.ensure_future(asyncio.to_thread(self.collect_store))
        try:
            while not work.done():
                await asyncio.wait({work}, timeout=self.lease_ttl / 3)
                if not work.done() and not await self._renew(token):
                    log.error("store gc lost the %s lease while it runs; the store's exclusive lock still keeps any "
                              "other collection out", GC_LEASE)
            report = work.result()
        except StoreError as exc:  # a writer holds the store (RepositoryLocked), or gc found it damaged (GcAborted)
            log.warning("store gc did not run: %s", exc)
            return None
        finally:
            if work.done():  # else (cancelled: the server stops) its thread runs on, and the lease expires after it
                with contextlib.suppress(Exception):
                    await self.leases.release(GC_LEASE, self.holder, token)
        self.gc_due = False
        self.last_gc = report
        log.info("store gc (paused retention, lease token %d): %s", token, report.summary())
        return report

    async def _renew(self, token: int) -> bool:
        try:
            return await self.leases.renew(GC_LEASE, self.holder, token, self.lease_ttl) is not None
        except KeepStateError as exc:  # the database is away: the lease may run out
            log.warning("renewing the %s lease: %s", GC_LEASE, exc)
            return False
