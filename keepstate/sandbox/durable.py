"""Checkpoints of live sandboxes: capture with runsc, ingest into the store, materialise and restore.

The sandbox is paused only for `runsc checkpoint` itself; ingest (chunk, hash, compress,
dedupe, upload) runs after the sandbox runs again. A restore materialises the checkpoint
with every chunk verified, refuses an image this host cannot run (other runsc release,
other template build, missing CPU features), then `runsc restore`s it.

What a resume needs when the catalog is gone (another host, lost data directory) travels
in the manifest's labels: the sandbox's settings, under the label "sandbox" as JSON.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from keepstate.errors import KeepStateError, NotFound, Refused
from keepstate.runtime.base import Handle, Runtime, RuntimeFailure, host_cpu_flags
from keepstate.store import (
    CheckpointMeta,
    CorruptCheckpoint,
    EventRef,
    HostFacts,
    ImageFile,
    IncompatibleCheckpoint,
    Manifest,
    Repository,
    StoreError,
    backend_from_url,
    ids,
    restore_problems,
)
from keepstate.template.builder import Built

from .record import SandboxRow, portable
from .templates import Templates, latest_digest

log = logging.getLogger("keepstate.sandbox")

# CPU features a memory image may depend on: instruction-set extensions user code picks at start-up.
_ISA_FLAGS = ("sse4_1", "sse4_2", "avx", "avx2", "avx512f", "avx512bw", "avx512vl", "fma", "bmi1", "bmi2",
              "aes", "sha_ni", "vaes", "vpclmulqdq", "pclmulqdq", "popcnt", "adx", "f16c", "movbe")


class CorruptCheckpointError(KeepStateError):
    status = 500


class Durability:
    def __init__(self, home: Path, runtime: Runtime, templates: Templates, store_url: str | None = None) -> None:
        self.home = home
        self.runtime = runtime
        self.templates = templates
        self.store_url = store_url or f"file://{home / 'store'}"
        self.repo = Repository.open(backend_from_url(self.store_url), cache_dir=home / "cache" / "store")
        self.images = home / "images"
        self.fast_images = _tmpfs_dir(home)
        for d in (self.images, self.fast_images):
            if d is not None:
                d.mkdir(parents=True, exist_ok=True)
        self.release = runtime.release
        flags = set(host_cpu_flags())
        self.cpu_features = tuple(f for f in _ISA_FLAGS if f in flags)

    def clear_images(self) -> None:
        """At server start: images left by a server that was killed are of use to nobody; nor are the folders in
        RAM of data directories that are gone (a server killed, then its data directory deleted)."""
        for d in (self.images, self.fast_images):
            if d is not None:
                for leftover in d.iterdir():
                    if leftover.name != HOME_MARK:
                        shutil.rmtree(leftover, ignore_errors=True)
        if self.fast_images is not None:
            (self.fast_images / HOME_MARK).write_text(str(self.home.resolve()))
            sweep_ram_folders(self.fast_images.parent)

    def close(self) -> None:
        """At server stop: the folder in RAM is per data directory; leave none behind."""
        if self.fast_images is not None:
            shutil.rmtree(self.fast_images, ignore_errors=True)

    # -- capture -----------------------------------------------------------------------
    def capture(self, row: SandboxRow) -> Path:
        """Run `runsc checkpoint` into a fresh image folder and return it. The sandbox is left as it was: running
        on, or (a pause) frozen."""
        handle = Handle(row.runtime_name, row.slot)
        image = Path(tempfile.mkdtemp(prefix="ckpt-", dir=self._capture_spool(handle, row.memory_mb)))
        try:
            try:
                self.runtime.checkpoint(handle, image, leave_running=True)
            except RuntimeFailure as first:
                # runsc 20240729 now and then fails a checkpoint of a busy sandbox; it keeps running, so one
                # more try is safe. The first failure is logged in full.
                log.warning("checkpoint of %s failed once, retrying: %s", row.sandbox_id, first)
                shutil.rmtree(image, ignore_errors=True)
                image.mkdir()
                time.sleep(0.2)
                self.runtime.checkpoint(handle, image, leave_running=True)
        except BaseException:
            shutil.rmtree(image, ignore_errors=True)
            raise
        return image

    def _capture_spool(self, handle: Handle, memory_mb: int) -> Path:
        """Where a checkpoint image is written. The sandbox's own sentry writes it, so a tmpfs image's pages are
        charged to the sandbox's memory cgroup (and stay charged until the file is deleted): an image about as
        large as the memory in use must fit beside it under the limit, or the kernel OOM-kills the sandbox in the
        middle of its checkpoint (seen: a sandbox holding 293 MB of 512 MB). Otherwise the data directory, whose
        page cache the kernel can write back and reclaim."""
        stats = self.runtime.cgroup_stats(handle)
        usage = stats.get("mem_used", 0) + stats.get("mem_cache", 0)
        limit = stats.get("mem_limit") or memory_mb << 20
        if limit - usage > usage + CAPTURE_MARGIN:
            return self._spool(memory_mb)
        return self.images

    def _spool(self, memory_mb: int) -> Path:
        """Where an image passes between runsc and the store: RAM (tmpfs) when it has room for it, so that
        neither side waits for a disk; else the data directory."""
        if self.fast_images is not None:
            try:
                st = os.statvfs(self.fast_images)
                if st.f_bavail * st.f_frsize > (memory_mb << 20) * 2:
                    return self.fast_images
            except OSError:
                pass
        return self.images

    def files_spool(self) -> Path:
        """A fresh folder for a filesystem-only pause's files (on disk: they may be larger than memory)."""
        return Path(tempfile.mkdtemp(prefix="files-", dir=self.images))

    def ingest(self, row: SandboxRow, image: Path, *, kind: str, parent_id: str | None,
               event: EventRef | None, checkpoint_id: str, memory: bool = True,
               listening: list[int] | None = None) -> Manifest:
        # Every image file, memory included, gets content-defined chunks: gVisor writes a memory file's
        # committed pages in allocation order, so between two checkpoints the same pages move by whole pages
        # and fixed blocks would miss almost all of them (measured: benchmarks/checkpoint.py).
        files = [ImageFile(p.name, p, "file") for p in sorted(image.iterdir()) if p.is_file()]
        labels = {"kind": kind, "sandbox": json.dumps(portable(row), sort_keys=True)}
        if not memory:
            labels["memory"] = "false"  # files only (files.tar): restored by a cold boot, never by runsc
        if listening is not None:  # what must accept again before a restore of it is handed out
            labels["listening"] = ",".join(str(p) for p in listening)
        meta = CheckpointMeta(
            session_id=row.session_id, checkpoint_id=checkpoint_id, parent_id=parent_id,
            template_id=row.template_id, template_digest=row.template_digest, runsc_release=self.release,
            cpu_features=self.cpu_features, sizes={"memory_mb": row.memory_mb, "cpu_millis": int(row.cpu * 1000)},
            event=event, labels=labels,
        )
        try:
            return self.repo.write_checkpoint(files, meta)
        finally:
            # Freeing a few hundred MiB takes tens of milliseconds a pause need not wait for; a server killed
            # meanwhile leaves the folder to clear_images().
            threading.Thread(target=shutil.rmtree, args=(image,), kwargs={"ignore_errors": True},
                             name="ks-image-cleanup", daemon=True).start()

    # -- restore -----------------------------------------------------------------------
    def manifest(self, checkpoint_id: str) -> Manifest:
        try:
            return self.repo.get_manifest(checkpoint_id)
        except CorruptCheckpoint as exc:
            raise CorruptCheckpointError(f"checkpoint {checkpoint_id} is corrupt: {exc}") from exc
        except StoreError as exc:
            raise NotFound(f"checkpoint {checkpoint_id} not found in the store: {exc}") from exc

    def template_for(self, manifest: Manifest) -> Built:
        """The local build with the checkpoint's template digest; refuse clearly if there is none."""
        meta = manifest.meta
        built = self.templates.find_by_digest(meta.template_id, meta.template_digest)
        files_only = not has_memory(manifest)  # no runsc image: another runsc release or CPU can boot it
        host = HostFacts(runsc_release=meta.runsc_release if files_only else self.release,
                         template_digest=built.digest if built else latest_digest(self.templates, meta.template_id),
                         cpu_features=meta.cpu_features if files_only else self.cpu_features)
        problems = restore_problems(manifest, host)
        if problems:
            raise Refused(f"checkpoint {manifest.checkpoint_id} cannot be restored on this host: "
                          + "; ".join(problems))
        assert built is not None
        return built

    def materialise(self, manifest: Manifest) -> Path:
        """Read and verify every chunk into a new image folder; nothing partial is ever left."""
        dest = Path(tempfile.mkdtemp(prefix="restore-", dir=self._spool(manifest.meta.sizes.get("memory_mb", 0))))
        dest.rmdir()
        try:
            self.repo.read_checkpoint(manifest.checkpoint_id, dest)
        except CorruptCheckpoint as exc:
            raise CorruptCheckpointError(f"refusing to restore checkpoint {manifest.checkpoint_id}: {exc}") from exc
        except IncompatibleCheckpoint as exc:
            raise Refused(str(exc)) from exc
        return dest

    def latest_for_session(self, session_id: str, kinds: tuple[str, ...] = ("pause",)) -> Manifest | None:
        found = [m for m in self.repo.list_checkpoints()
                 if m.meta.session_id == session_id and m.meta.labels.get("kind") in kinds]
        return found[-1] if found else None


def has_memory(manifest: Manifest) -> bool:
    """False for a filesystem-only pause's checkpoint (its one file is files.tar)."""
    return manifest.meta.labels.get("memory") != "false"


def listening_ports(manifest: Manifest) -> list[int] | None:
    """The ports that listened on a reachable address when the checkpoint was taken (agent/listening.py); None for
    a checkpoint that does not say (taken before the label existed, or the agent could not tell)."""
    text = manifest.meta.labels.get("listening")
    if text is None:
        return None
    try:
        return [int(p) for p in text.split(",") if p]
    except ValueError:
        return None


FILES_ARCHIVE = "files.tar"  # the image file of a filesystem-only checkpoint
CAPTURE_MARGIN = 64 << 20  # beyond the image's size: what runsc checkpoint itself needs in the sandbox's cgroup
HOME_MARK = ".home"  # in each server's folder in RAM: the data directory it belongs to


def sweep_ram_folders(root: Path) -> list[Path]:
    """Remove the keepstate-* folders under `root` whose data directory is gone; return them."""
    gone = []
    for folder in root.glob("keepstate-*"):
        try:
            home = Path((folder / HOME_MARK).read_text().strip())
        except OSError:
            continue  # not marked: whose it is cannot be told, so it stays
        if not home.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder)
    return gone


def _tmpfs_dir(home: Path) -> Path | None:
    """This server's folder in /dev/shm when that is a tmpfs we can write (one per data directory)."""
    shm = Path("/dev/shm")
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    if not any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in mounts if len(line.split()) > 2):
        return None
    if not os.access(shm, os.W_OK):
        return None
    return shm / f"keepstate-{ids.hexdigest(str(home.resolve()).encode())[:16]}"
