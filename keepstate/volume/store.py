"""The host side of volumes: each one's directory tree, its quota and its mount (docs/design/volumes.md).

    <home>/volumes/<volumeID>/image.ext4      the quota: a sparse ext4 image (backend "ext4")
    <home>/volumes/<volumeID>/fs/             its mount point (backend "dir": a plain directory)
    <home>/volumes/<volumeID>/fs/data/        the volume root, bind-mounted into sandboxes
    <home>/volumes/<volumeID>/fs/.uploads/    uploads being written

Disk first, database last on create; database first, disk last on destroy: a crash leaves at worst a directory
with no row, which `mount_all` (at every start) removes.
"""

from __future__ import annotations

import asyncio
import builtins
import hmac
import logging
import os
import re
import secrets
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path

from keepstate.db.engine import Database
from keepstate.db.repos import Volumes as VolumesRepo
from keepstate.errors import BadRequest, Conflict, NotFound, Refused, Unauthorized, Unavailable

from .paths import DEFAULT_GID, DEFAULT_UID, VolumeRoot
from .record import VolumeRecord

log = logging.getLogger("keepstate.volume")

NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")
MIN_SIZE_MB, MAX_SIZE_MB = 16, 1 << 20
DEFAULT_SIZE_MB = 1024
BACKENDS = ("ext4", "dir")
MOUNT_OPTIONS = "loop,nodev,nosuid"


def new_volume_id() -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "vol" + "".join(secrets.choice(alphabet) for _ in range(17))


def new_token() -> str:
    return "vol_" + secrets.token_hex(20)


def _run(*cmd: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise Unavailable(f"`{' '.join(cmd)}` failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()}")


class Gate:
    """A readers-writer gate of one volume: content calls share it, a destroy takes it alone."""

    def __init__(self) -> None:
        self.readers = 0
        self.closed = False
        self._changed = asyncio.Condition()

    @asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._changed:
            if self.closed:
                raise NotFound("volume is being destroyed")
            self.readers += 1
        try:
            yield
        finally:
            async with self._changed:
                self.readers -= 1
                self._changed.notify_all()

    async def close(self) -> None:
        async with self._changed:
            self.closed = True
            await self._changed.wait_for(lambda: self.readers == 0)


class Volumes:
    """Every volume of this server. The disk work of a create or destroy runs in a thread of its own."""

    def __init__(self, home: Path, db: Database, backend: str = "ext4",
                 default_size_mb: int = DEFAULT_SIZE_MB) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"volume backend must be one of {BACKENDS}, not {backend!r}")
        self.base = home / "volumes"
        self.repo = VolumesRepo(db)
        self.backend = backend
        self.default_size_mb = default_size_mb
        self._gates: dict[str, Gate] = {}
        self._pins: Counter[str] = Counter()
        self._forgetting: set[str] = set()  # destroys under way: no create pins them any more

    # -- layout ------------------------------------------------------------------------------------------------
    def dir(self, volume_id: str) -> Path:
        return self.base / volume_id

    def data(self, volume_id: str) -> Path:
        return self.dir(volume_id) / "fs" / "data"

    def root(self, vol: VolumeRecord) -> VolumeRoot:
        quota = vol.size_mb << 20 if self.backend == "dir" else None
        return VolumeRoot(self.data(vol.volume_id), self.dir(vol.volume_id) / "fs" / ".uploads", quota)

    # -- reading -----------------------------------------------------------------------------------------------
    async def get(self, volume_id: str) -> VolumeRecord:
        vol = await self.repo.get(volume_id)
        if vol is None:
            raise NotFound(f"volume '{volume_id}' not found")
        return vol

    async def list(self) -> builtins.list[VolumeRecord]:
        return await self.repo.list()

    async def authorize(self, volume_id: str, header: str | None) -> VolumeRecord:
        """The volume a content request may use: `Authorization: Bearer <its token>` (401), existing (404)."""
        if not header or not header.startswith("Bearer ") or not header[7:].strip():
            raise Unauthorized("missing volume token: send `Authorization: Bearer <token>` (the token "
                               "POST /volumes or GET /volumes/{volumeID} returned; not the API key)")
        token = header[7:].strip()
        vol = await self.repo.get(volume_id)
        if vol is None:
            raise NotFound(f"volume '{volume_id}' not found")
        if not hmac.compare_digest(token.encode("utf-8", "replace"), vol.token.encode()):
            raise Unauthorized(f"invalid token for volume '{volume_id}'")
        return vol

    def gate(self, volume_id: str) -> Gate:
        gate = self._gates.get(volume_id)
        if gate is None:
            gate = self._gates[volume_id] = Gate()
        return gate

    # -- create and destroy ------------------------------------------------------------------------------------
    def check_new(self, name: object, size_mb: object) -> tuple[str, int]:
        if not isinstance(name, str) or not NAME.match(name):
            raise BadRequest("`name` must be 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or "
                             "digit")
        if size_mb is None:
            size_mb = self.default_size_mb
        if isinstance(size_mb, bool) or not isinstance(size_mb, int) or not MIN_SIZE_MB <= size_mb <= MAX_SIZE_MB:
            raise BadRequest(f"`sizeMB` must be a whole number from {MIN_SIZE_MB} to {MAX_SIZE_MB}")
        return name, size_mb

    async def create(self, name: str, size_mb: int) -> VolumeRecord:
        """Make the volume on disk, then record it; a name taken meanwhile undoes the disk work (Conflict)."""
        if await self.repo.by_name(name) is not None:
            raise Conflict(f"a volume named '{name}' exists")
        vol = VolumeRecord(volume_id=new_volume_id(), name=name, token=new_token(), size_mb=size_mb,
                           created_at=time.time())
        try:
            await asyncio.to_thread(self._provision, vol)
            await self.repo.put(vol)  # Conflict when the name was taken meanwhile
        except BaseException:
            await asyncio.to_thread(self._remove_disk, vol.volume_id)
            raise
        log.info("volume %s (%s) created: %d MiB, backend %s", vol.volume_id, name, size_mb, self.backend)
        return vol

    def _provision(self, vol: VolumeRecord) -> None:
        d = self.dir(vol.volume_id)
        fs = d / "fs"
        fs.mkdir(parents=True)
        if self.backend == "ext4":
            image = d / "image.ext4"
            with open(image, "wb") as f:
                f.truncate(vol.size_mb << 20)
            _run("mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-E", "lazy_itable_init=1,nodiscard", "-m", "0",
                 str(image))
            self._mount(vol.volume_id)
            (fs / "lost+found").rmdir()
        data = fs / "data"
        data.mkdir()
        os.chown(data, DEFAULT_UID, DEFAULT_GID)
        data.chmod(0o755)
        (fs / ".uploads").mkdir(mode=0o700)

    def _mount(self, volume_id: str) -> None:
        fs = self.dir(volume_id) / "fs"
        if self.backend == "ext4" and not os.path.ismount(fs):
            _run("mount", "-o", MOUNT_OPTIONS, str(self.dir(volume_id) / "image.ext4"), str(fs))

    def _unmount(self, volume_id: str) -> None:
        fs = self.dir(volume_id) / "fs"
        if self.backend == "ext4" and os.path.ismount(fs):
            res = subprocess.run(["umount", str(fs)], capture_output=True, text=True, timeout=60)
            if res.returncode != 0:  # still busy (a process on the host): detach now, freed when it lets go
                log.warning("umount of %s failed (%s); detaching it lazily", fs, res.stderr.strip())
                _run("umount", "-l", str(fs))

    def _remove_disk(self, volume_id: str) -> None:
        d = self.dir(volume_id)
        if not d.exists():
            return
        self._unmount(volume_id)
        shutil.rmtree(d, ignore_errors=True)

    async def forget(self, volume_id: str, users: Callable[[], Iterable[str]]) -> VolumeRecord:
        """Step one of a destroy: refuse while anything mounts the volume (`users()`, asked with no await between
        it and the refusal of new pins), else drop its row (new calls get 404)."""
        vol = await self.get(volume_id)
        if volume_id in self._forgetting:
            raise NotFound(f"volume '{volume_id}' not found")
        busy = sorted(set(users()))
        if busy:
            raise Conflict(f"volume '{vol.name}' is mounted by sandbox {', '.join(busy)}; kill "
                           f"{'it' if len(busy) == 1 else 'them'} first")
        if self._pins[volume_id]:
            raise Conflict(f"volume '{vol.name}' is being mounted by a sandbox that is starting; retry")
        self._forgetting.add(volume_id)  # from here no create pins it, whatever the await below lets run
        try:
            await self.repo.delete(volume_id)
        finally:
            self._forgetting.discard(volume_id)
        return vol

    def remove(self, volume_id: str) -> None:
        """Step two of a destroy, once no content call runs (Gate.close): unmount and delete its data."""
        self._remove_disk(volume_id)
        self._gates.pop(volume_id, None)
        log.info("volume %s destroyed", volume_id)

    # -- mounts for sandboxes ----------------------------------------------------------------------------------
    @asynccontextmanager
    async def pinned(self, names: Iterable[str]) -> AsyncIterator[dict[str, VolumeRecord]]:
        """Resolve volume names (BadRequest for an unknown one) and hold them against a destroy meanwhile."""
        found: dict[str, VolumeRecord] = {}
        for name in names:
            vol = await self.repo.by_name(name)
            if vol is None:
                raise BadRequest(f"volume '{name}' not found (create it with Volume.create or POST /volumes)")
            found[name] = vol
        for vol in found.values():  # no await from this check to the pins below
            if vol.volume_id in self._forgetting:
                raise BadRequest(f"volume '{vol.name}' not found (it is being destroyed)")
        for vol in found.values():
            self._pins[vol.volume_id] += 1
        try:
            yield found
        finally:
            for vol in found.values():
                self._pins[vol.volume_id] -= 1
                if not self._pins[vol.volume_id]:
                    del self._pins[vol.volume_id]

    async def source(self, volume_id: str, name: str) -> Path:
        """The host directory to bind-mount for a volume a sandbox names; Refused if it is gone (a snapshot)."""
        if await self.repo.get(volume_id) is None:
            raise Refused(f"volume '{name}' ({volume_id}) no longer exists; the checkpoint was taken with it "
                          "mounted and gVisor restores only onto the same mounts")
        return self.data(volume_id)

    # -- start and stop ----------------------------------------------------------------------------------------
    async def mount_all(self) -> None:
        """At start: mount every volume in the database that is not (after a reboot or a reap-on-exit stop), and
        remove directories left by a create or destroy that crashed half-way."""
        known = {v.volume_id for v in await self.repo.list()}
        await asyncio.to_thread(self._mount_all, known)

    def _mount_all(self, known: set[str]) -> None:
        if self.base.exists():
            for d in self.base.iterdir():
                if d.name not in known:
                    log.warning("removing %s: no volume of that ID in the catalog (a crash mid-create/destroy)", d)
                    self._remove_disk(d.name)
        for vid in sorted(known):
            if not self.dir(vid).exists():
                log.error("volume %s is in the catalog but its data directory %s is gone", vid, self.dir(vid))
                continue
            self._mount(vid)
        if known:
            log.info("%d volume(s) ready (backend %s)", len(known), self.backend)

    async def unmount_all(self) -> None:
        await asyncio.to_thread(self._unmount_all, await self.repo.list())

    def _unmount_all(self, volumes: builtins.list[VolumeRecord]) -> None:
        for vol in volumes:
            try:
                self._unmount(vol.volume_id)
            except Unavailable as exc:
                log.warning("unmount of volume %s failed: %s", vol.volume_id, exc)
