"""Servers of their own for durability tests that kill servers, lose data directories or corrupt stores."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.sdk.sdkharness import KEEPSTATE, TEMPLATE_CACHE, Server, make_key, start_server  # noqa: F401
from tests.store.conftest import s3_server  # noqa: F401  (a real SeaweedFS on loopback)


@dataclass
class Fleet:
    """Servers started by one test; all of them stopped (and their sandboxes reaped) at the end."""

    servers: list[Server] = field(default_factory=list)

    def start(self, home: str | None = None, port: int | None = None, store: str | None = None,
              cache: str | None = None, extra: tuple[str, ...] = ()) -> Server:
        """Start a server; `extra` are more `keepstate serve` arguments (e.g. --gateway-config PATH)."""
        home = home or tempfile.mkdtemp(prefix="keepstate-durable-")
        args: tuple[str, ...] = ("--reap-on-exit", *extra)
        if store:
            args += ("--store", store)
        srv = start_server(home, port=port, pool=0, extra=args, template_cache=cache)
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
