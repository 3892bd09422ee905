"""Fixtures: a real fake provider and a real gateway, both on 127.0.0.1 with free ports, state in tmp dirs.

The gateway's database (`gw_database`) is a new SQLite file: its logic does not depend on the engine. A module
whose tests are about what the database keeps (test_store.py, test_budgets.py) overrides `gw_database` with the
`database` fixture, and its tests run on SQLite and on PostgreSQL."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from keepstate.db import migrate
from keepstate.db.engine import Database
from keepstate.db.url import default_url
from keepstate.gateway import GATEWAY, Gateway, GatewayConfig, ProviderConfig, create_app
from keepstate.testing import FakeProvider
from keepstate.testing.databases import database, db_url, postgres  # noqa: F401

HOST_KEY = "sk-host-secret"
PRICES = {"version": 1, "models": {"fake-*": {"input": 1.0, "cached_input": 0.5, "output": 2.0},
                                   "claude-fake*": {"input": 3.0, "cached_input": 0.3, "cache_write": 3.75,
                                                    "output": 15.0}}}


@dataclass
class Env:
    fake: FakeProvider
    gateway: Gateway
    url: str
    config: GatewayConfig
    runner: web.AppRunner
    db: Database

    async def token(self, session: str = "sess", sandbox: str = "sbx", key: str | None = "key", **kw: Any) -> str:
        return await self.gateway.register_run(session, sandbox, key, kw.pop("checkpoint_id", None), **kw)

    async def post(self, token: str, path: str, body: dict[str, Any],
                   **headers: str) -> tuple[int, dict[str, str], bytes]:
        async with aiohttp.ClientSession() as s:
            async with s.post(self.url + path, json=body, headers={"authorization": f"Bearer {token}", **headers}) as r:
                return r.status, dict(r.headers), await r.read()


def make_config(fake: FakeProvider, home: Path, **kw: Any) -> GatewayConfig:
    prices = home / "prices.json"
    prices.write_text(json.dumps(PRICES))
    return GatewayConfig(
        providers=[
            ProviderConfig("fake-openai", "openai", fake.openai_base_url, HOST_KEY, ("fake-*",),
                           stats_url=fake.stats_url),
            ProviderConfig("fake-anthropic", "anthropic", fake.anthropic_base_url, HOST_KEY, ("claude-fake*",)),
        ],
        data_dir=home, price_table=prices, **kw,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Standalone:
    """A `keepstate gateway` process, and a lead Gateway in this process sharing its database (the default one of
    its data directory)."""

    lead: Gateway
    url: str
    home: Path
    config_path: Path
    db: Database


@contextlib.asynccontextmanager
async def standalone_gateway(fake: FakeProvider, tmp_path: Path, **provider: Any) -> AsyncIterator[Standalone]:
    """Start `keepstate gateway` (one OpenAI-kind provider: the fake, for `fake-*`; more provider keys in
    `provider`) with its config and home under tmp_path; stop it afterwards."""
    (tmp_path / "prices.json").write_text(json.dumps({"version": 1, "models": {"fake-*": {"input": 1, "output": 2}}}))
    config_path = tmp_path / "gateway.json"
    config_path.write_text(json.dumps({
        "providers": [{"name": "fake", "kind": "openai", "base_url": fake.openai_base_url, "api_key": HOST_KEY,
                       "models": ["fake-*"], **provider}],
        "price_table": str(tmp_path / "prices.json"),
    }))
    home = tmp_path / "home"
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if k != "KEEPSTATE_DB"}  # the default database of `home`
    proc = subprocess.Popen([sys.executable, "-m", "keepstate.cli.main", "gateway", "--listen", f"127.0.0.1:{port}",
                             "--config", str(config_path), "--home", str(home)], stderr=subprocess.DEVNULL, env=environ)
    try:
        cfg = GatewayConfig.from_file(config_path)
        cfg.data_dir = home
        db = await Database.open(default_url(home))
        try:
            await migrate.upgrade(db)  # the process may not have yet: both do it, once (migrate.py)
            yield Standalone(Gateway(cfg, db), f"http://127.0.0.1:{port}", home, config_path, db)
        finally:
            await db.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def start_gateway(config: GatewayConfig, db: Database) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(create_app(config, db))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture
async def fake() -> AsyncIterator[FakeProvider]:
    async with FakeProvider(api_key=HOST_KEY) as f:
        yield f


@contextlib.asynccontextmanager
async def sqlite_database(home: Path) -> AsyncIterator[Database]:
    """A new SQLite database at the default place in `home`, upgraded to head."""
    db = await Database.open(default_url(home))
    try:
        await migrate.upgrade(db)
        yield db
    finally:
        await db.close()


@pytest.fixture
async def gw_database(tmp_path: Path) -> AsyncIterator[Database]:
    """The gateway's database: SQLite, in the test's data directory (overridden by the store-level modules)."""
    async with sqlite_database(tmp_path) as db:
        yield db


@pytest.fixture
async def env(fake: FakeProvider, tmp_path: Path, gw_database: Database) -> AsyncIterator[Env]:
    config = make_config(fake, tmp_path, upstream_timeout_s=2.0)
    runner, url = await start_gateway(config, gw_database)
    yield Env(fake, runner.app[GATEWAY], url, config, runner, gw_database)
    await runner.cleanup()
