"""Servers of their own for durability tests that kill servers, lose data directories or corrupt stores."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.sdk.sdkharness import KEEPSTATE, TEMPLATE_CACHE, Server, make_key, start_server
from tests.store.conftest import s3_server  # noqa: F401  (a real SeaweedFS on loopback)


@dataclass
class Fleet:
    """Servers started by one test; all of them stopped (and their sandboxes reaped) at the end."""

    servers: list[Server] = field(default_factory=list)

    def start(self, home: str | None = None, port: int | None = None, store: str | None = None,
              cache: str | None = None, extra: tuple[str, ...] = (), db: str | None = None) -> Server:
        """Start a server; `extra` are more `keepstate serve` arguments (e.g. --gateway-config PATH); `db` its
        database (default: SQLite in its data directory)."""
        home = home or tempfile.mkdtemp(prefix="keepstate-durable-")
        args: tuple[str, ...] = ("--reap-on-exit", *extra)
        if store:
            args += ("--store", store)
        if db:
            args += ("--db", db)
        srv = start_server(home, port=port, pool=0, extra=args, template_cache=cache)
        if db:
            srv.key = subprocess.check_output([str(KEEPSTATE), "keys", "create", "durable", "--db", db],
                                              env={**os.environ, "KEEPSTATE_HOME": home},
                                              stderr=subprocess.DEVNULL).decode().strip()
        else:
            srv.key = make_key(home)
        self.servers.append(srv)
        return srv

    def sigkill(self, srv: Server) -> None:
        assert srv.proc is not None
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()

    def stop_all(self) -> None:
        for srv in self.servers:
            if srv.proc is not None and srv.proc.poll() is None:
                srv.proc.terminate()
                try:
                    srv.proc.wait(timeout=60)
                except Exception:
                    srv.proc.kill()
        # A server these tests SIGKILLed may have left sandboxes behind (that is the point of the tests): a
        # server started on each surviving data directory adopts them, and --reap-on-exit destroys them.
        for home in {srv.home for srv in self.servers}:
            if not os.path.exists(os.path.join(home, "keepstate.sqlite")):  # no server ever started on it
                continue
            reaper = start_server(home, pool=0, extra=("--reap-on-exit", "--warm", ""))
            assert reaper.proc is not None
            reaper.proc.terminate()
            reaper.proc.wait(timeout=120)
        _destroy_leftovers({srv.home for srv in self.servers})


def _destroy_leftovers(homes: set[str]) -> None:
    """Last resort after SIGKILL tests: any sandbox still holding a slot for one of our data directories."""
    import json

    from keepstate.runtime import network
    from keepstate.runtime.base import Handle
    from keepstate.runtime.gvisor import GVisorRuntime

    slots = Path(network.SLOTS_DIR)
    for entry in slots.glob("[0-9]*"):
        try:
            owner = json.loads(entry.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(owner, dict) and owner.get("home") in homes:
            runtime = GVisorRuntime(Path(owner["home"]) / "sandboxes")
            runtime.destroy(Handle(owner["name"], int(entry.name)))
            network.release_slot(int(entry.name))


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    try:
        yield f
    finally:
        f.stop_all()


def sdk_opts(srv: Server) -> dict[str, str]:
    return {"api_key": srv.key, "api_url": srv.url, "sandbox_url": srv.url}


def keepstate_env(srv: Server) -> dict[str, str]:
    return {**os.environ, "KEEPSTATE_HOME": srv.home, "KEEPSTATE_TEMPLATE_CACHE": TEMPLATE_CACHE}


def store_path(srv: Server) -> Path:
    return Path(srv.home) / "store"
