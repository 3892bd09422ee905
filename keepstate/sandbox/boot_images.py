"""Boot images: a new sandbox is restored from a checkpoint of a fresh boot (docs/design/boot-images.md).

A cold boot costs ~2 s of CPU here (1.2 s of it the agent's Python imports under gVisor); a restore a fraction of
that. The first instance of a template build with a given set of limits boots cold and, once its agent answers and
before it gets its /init (so before it holds any token, environment or session), is checkpointed into
`<home>/boot-images/<key>/`. Later instances of the same key are restored from that image, each on a fresh disk
and slot; a failed restore discards the image and the instance boots cold (and writes a new one).

Only for what a checkpoint can carry: no volumes (bind mounts restore only onto the same ones) and no template
services (e.g. the code interpreter's kernels listen on loopback TCP, which a restore resets). Images are removed
when a server starts: they hold the agent's code and memory as of the server that wrote them.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

from keepstate.runtime.base import Handle, Limits, Runtime

log = logging.getLogger("keepstate.sandbox")

READY = "ready"  # written last: an image without it is incomplete


class BootImages:
    def __init__(self, home: Path, runtime: Runtime, enabled: bool = True) -> None:
        self.root = home / "boot-images"
        self.runtime = runtime
        self.enabled = enabled
        self._capturing: set[str] = set()
        shutil.rmtree(self.root, ignore_errors=True)

    @staticmethod
    def key(digest: str, limits: Limits) -> str:
        return f"{digest}-c{limits.cpu:g}-m{limits.memory_mb}-d{limits.disk_mb}-p{limits.pids}"

    def image(self, key: str) -> Path | None:
        path = self.root / key
        return path if self.enabled and (path / READY).exists() else None

    def wanted(self, key: str) -> bool:
        """Whether an instance of this key that just booted cold should be captured (none is, or is being)."""
        return self.enabled and key not in self._capturing and self.image(key) is None

    async def capture(self, key: str, handle: Handle) -> None:
        """Checkpoint a just-booted instance (no connection open into it) as the image of `key`; it runs on.
        A failure is logged and leaves no image: the next instance boots cold and tries again."""
        if not self.wanted(key):
            return
        self._capturing.add(key)
        tmp = self.root / f".{key}.{time.monotonic_ns()}"
        try:
            t = time.monotonic()
            await asyncio.to_thread(self.runtime.checkpoint, handle, tmp, True)
            (tmp / READY).write_text(handle.name)
            await asyncio.to_thread(shutil.rmtree, self.root / key, True)
            tmp.rename(self.root / key)
            log.info("boot image %s written from %s in %.0f ms", key, handle.name, (time.monotonic() - t) * 1000)
        except Exception as exc:
            log.warning("boot image %s from %s failed: %s; the next instance boots cold", key, handle.name, exc)
        finally:
            self._capturing.discard(key)
            shutil.rmtree(tmp, ignore_errors=True)

    def discard(self, key: str, why: str) -> None:
        log.warning("discarding boot image %s: %s", key, why)
        path = self.root / key
        if path.exists():
            # Renamed first: a restore reading it now keeps its files; the next capture gets a clean name.
            gone = self.root / f".gone.{key}.{time.monotonic_ns()}"
            try:
                path.rename(gone)
            except OSError:
                return
            shutil.rmtree(gone, ignore_errors=True)
