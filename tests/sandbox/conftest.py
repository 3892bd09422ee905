"""A KeepState server in the test's own process, on the fake runtime or on gVisor, so that tests can drive it over
HTTP and also look at what its manager and runtime hold."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from keepstate.api.app import ServerConfig, create_app
from keepstate.api.keys import DATABASE, MANAGER
from keepstate.apikeys import issue
from keepstate.db.repos import Keys
from keepstate.runtime.base import Runtime
from keepstate.sandbox.manager import SandboxManager
from keepstate.sandbox.record import SandboxRow, TeardownRecord
from keepstate.sandbox.rows import SandboxRows
from keepstate.testing import FakeRuntime, FakeTemplates
from keepstate.testing.databases import postgres  # noqa: F401
from keepstate.testing.postgres import PostgresServer

TEMPLATE_CACHE = "/var/lib/keepstate/templates"
os.environ.setdefault("KEEPSTATE_VALIDATE_RESPONSES", "1")  # every answer checked against docs/openapi.yaml


def gvisor_unavailable() -> str | None:
    """Why gVisor sandboxes cannot run here, or None."""
    from keepstate.runtime.gvisor import have_runsc

    if not have_runsc():
        return "needs root and runsc (make setup)"
    os.environ.setdefault("KEEPSTATE_TEMPLATE_CACHE", TEMPLATE_CACHE)
    from keepstate.template import builder

    try:
        if builder.latest("base") is None:
            return "the base template is not built (make test builds it first)"
    except Exception as exc:  # noqa: BLE001 - any reason is a reason to skip, named
        return f"the base template cannot be read: {exc}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    url: str
    key: str
    manager: SandboxManager
    runtime: Runtime
    http: aiohttp.ClientSession
    home: Path
    app: web.Application | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"X-API-KEY": self.key}

    @property
    def stored(self) -> SandboxRows:
        """The database's rows as another reader sees them: not the manager's own SandboxRows, whose reads would move
        the versions it conditions its writes on."""
        return SandboxRows(self.manager.db, self.manager.rows.node_id)

    async def row(self, sandbox_id: str) -> SandboxRow | None:
        """The sandbox's row in the database (None: it has none)."""
        return await self.stored.get(sandbox_id)

    async def teardowns(self) -> list[TeardownRecord]:
        """The teardowns recorded in the database and not yet done."""
        return await self.stored.teardowns()

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with self.http.request(method, self.url + path, json=body, headers=self.headers) as r:
            text = await r.text()
            try:
                import json

                return r.status, json.loads(text) if text else None
            except ValueError:
                return r.status, text


@contextlib.asynccontextmanager
async def serving(kind: str = "fake", home: Path | None = None, runtime: Runtime | None = None, key: str | None = None,
                  **options: Any) -> AsyncIterator[Served]:
    """A server in this process on `kind` ("fake" or "gvisor"); `runtime` and `home` let a second server take over
    the first one's sandboxes (adoption). Options are ServerConfig fields."""
    home = home or Path(tempfile.mkdtemp(prefix="keepstate-inproc-"))
    owned: FakeRuntime | None = None
    port = free_port()  # known to the app: a node of a cluster advertises it
    options = {"pool_size": 2, "warm_templates": ("base",), "reap_on_exit": True, "port": port, **options}
    if kind == "gvisor":
        why = gvisor_unavailable()
        if why:
            pytest.skip(why)
        app = create_app(ServerConfig(home=home, **options), runtime)
    else:
        if runtime is None:
            runtime = owned = FakeRuntime()  # closed once the server is (its network fd, its instances)
        # Lifecycle tests count the fake's creates and restores: boot images (tests/sandbox/test_boot_images.py)
        # only where asked for.
        options.setdefault("boot_images", False)
        app = create_app(ServerConfig(home=home, runtime="fake", **options), runtime, FakeTemplates())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    key = key or (await issue(Keys(app[DATABASE]), "tests"))[1]  # after startup: it migrates the database
    manager = app[MANAGER]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
        try:
            yield Served(f"http://127.0.0.1:{port}", key, manager, manager.runtime, http, home, app)
        finally:
            await runner.cleanup()
            if owned is not None:
                owned.close()


@pytest.fixture
async def served(request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    """A server on the runtime the test is parametrised with ("fake" or "gvisor"; "fake-postgresql": the fake
    runtime on a new database of the session's PostgreSQL instead of SQLite)."""
    kind = getattr(request, "param", "fake")
    options: dict[str, Any] = {}
    if kind == "fake-postgresql":
        pg: PostgresServer = request.getfixturevalue("postgres")
        kind, options["db_url"] = "fake", pg.createdb(f"served_{secrets.token_hex(6)}")
    async with serving(kind, **options) as s:
        yield s
