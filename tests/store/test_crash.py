"""kill -9 of a writer in the middle of write_checkpoint: nothing partial is listed, the previous checkpoint still
restores, and gc reclaims the leftovers (rules W1-W5, D2-D4)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from keepstate.store import Backend, CheckpointMeta, ImageFile, LocalBackend, RepoConfig, Repository
from tests.store.conftest import ACCESS_KEY, SECRET_KEY, MiB, write_memory_image

# The child stores packs normally until `n` are stored; then it hangs inside the next pack's save (for the local
# backend: after the temporary file is written, before the rename), tells the parent, and waits to be killed.
CHILD = textwrap.dedent("""
    import os, stat, sys, threading, time
    from pathlib import Path
    from keepstate.store import CheckpointMeta, ImageFile, LocalBackend, Repository, backend_from_url

    url, image, marker, n = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    backend = backend_from_url(url)
    inner_save, inner_save_parts = backend.save, backend.save_parts
    real_fsync = os.fsync
    lock = threading.Lock()
    started = done = 0
    hanging = None  # the thread storing pack n (packs are stored by several threads at once)

    def hang():
        marker.write_text(str(os.getpid()))
        time.sleep(600)

    def fsync(fd):
        if threading.get_ident() == hanging and stat.S_ISREG(os.fstat(fd).st_mode):  # the pack's file, not a folder
            hang()
        real_fsync(fd)

    os.fsync = fsync

    def store(inner, key, data):
        global started, done, hanging
        if not key.startswith("packs/"):
            return inner(key, data)
        with lock:
            mine, started = started, started + 1
        if mine == n:
            while done < n:  # the packs before it are stored
                time.sleep(0.01)
            if isinstance(backend, LocalBackend):
                hanging = threading.get_ident()
            else:
                hang()
        inner(key, data)
        with lock:
            done += 1

    backend.save = lambda key, data: store(inner_save, key, data)
    backend.save_parts = lambda key, parts: store(inner_save_parts, key, parts)  # how packs are stored
    repo = Repository.open(backend)
    repo.write_checkpoint([ImageFile("pages.img", image, "memory")], CheckpointMeta(session_id="doomed"))
    print("finished without being killed", flush=True)
""")


def store_url(backend: Backend) -> str:
    if isinstance(backend, LocalBackend):
        return backend.location
    return f"{backend.location}&access_key={ACCESS_KEY}&secret_key={SECRET_KEY}"


def keys(backend: Backend) -> set[str]:
    return {i.key for i in backend.list("")}


def test_kill_9_during_write_then_gc(backend: Backend, tmp_path: Path) -> None:
    repo = Repository.init(backend, config=RepoConfig(pack_target_size=MiB))
    image = tmp_path / "pages.img"
    write_memory_image(image, 6 * MiB, seed=31, random_share=0.6)
    previous = repo.write_checkpoint([ImageFile("pages.img", image, "memory")], CheckpointMeta(session_id="s"))
    before = keys(backend)
    original = image.read_bytes()

    write_memory_image(image, 8 * MiB, seed=32, random_share=0.8)  # mostly new data: several new packs
    marker = tmp_path / "hanging"
    child = subprocess.Popen([sys.executable, "-c", CHILD, store_url(backend), str(image), str(marker), "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            if child.poll() is not None:
                pytest.fail(f"writer exited before hanging: {child.communicate()}")
            if time.monotonic() > deadline:
                pytest.fail("writer never reached the hang point")
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL

    leftovers = keys(backend) - before
    assert len([k for k in leftovers if k.startswith("packs/")]) >= 2
    assert [k for k in leftovers if k.startswith("locks/")], "the dead writer's lock is left behind"
    assert not [k for k in leftovers if k.startswith(("refs/", "manifests/", "index/"))]

    repo = Repository.open(backend)
    assert [m.checkpoint_id for m in repo.list_checkpoints()] == [previous.checkpoint_id]
    repo.read_checkpoint(previous.checkpoint_id, tmp_path / "out1")
    assert (tmp_path / "out1" / "pages.img").read_bytes() == original
    report = repo.verify()
    assert report.ok and any("no index lists" in note for note in report.notes)

    gc = repo.gc()
    assert gc.stale_locks_removed == 1
    assert gc.packs_removed >= 2 and gc.bytes_freed > 0
    if isinstance(backend, LocalBackend):
        assert gc.leftover_bytes_removed > 0  # the temporary file of the interrupted save
        assert not list((tmp_path / "store").rglob(".tmp-*"))
    assert keys(backend) == before
    repo.read_checkpoint(previous.checkpoint_id, tmp_path / "out2")
    assert (tmp_path / "out2" / "pages.img").read_bytes() == original
    again = repo.write_checkpoint([ImageFile("pages.img", image, "memory")], CheckpointMeta(session_id="s"))
    repo.read_checkpoint(again.checkpoint_id, tmp_path / "out3")
    assert (tmp_path / "out3" / "pages.img").read_bytes() == image.read_bytes()
