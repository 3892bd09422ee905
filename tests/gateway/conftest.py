"""Fixtures: a real fake provider and a real gateway, both on 127.0.0.1 with free ports, state in tmp dirs."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from keepstate.gateway import GATEWAY, Gateway, GatewayConfig, ProviderConfig, create_app
from keepstate.testing import FakeProvider

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

    def token(self, session: str = "sess", sandbox: str = "sbx", key: str | None = "key", **kw: Any) -> str:
        return self.gateway.register_run(session, sandbox, key, kw.pop("checkpoint_id", None), **kw)

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
    """A `keepstate gateway` process, and a lead Gateway in this process sharing its data directory."""

    lead: Gateway
    url: str
    home: Path
    config_path: Path


@contextlib.contextmanager
def standalone_gateway(fake: FakeProvider, tmp_path: Path, **provider: Any) -> Iterator[Standalone]:
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
    proc = subprocess.Popen([sys.executable, "-m", "keepstate.cli.main", "gateway", "--listen", f"127.0.0.1:{port}",
                             "--config", str(config_path), "--home", str(home)], stderr=subprocess.DEVNULL)
    try:
        cfg = GatewayConfig.from_file(config_path)
        cfg.data_dir = home
        lead = Gateway(cfg)
        try:
            yield Standalone(lead, f"http://127.0.0.1:{port}", home, config_path)
        finally:
            lead.store.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def start_gateway(config: GatewayConfig) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(create_app(config))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture
async def fake() -> AsyncIterator[FakeProvider]:
    async with FakeProvider(api_key=HOST_KEY) as f:
        yield f


@pytest.fixture
async def env(fake: FakeProvider, tmp_path: Path) -> AsyncIterator[Env]:
    config = make_config(fake, tmp_path, upstream_timeout_s=2.0)
    runner, url = await start_gateway(config)
    yield Env(fake, runner.app[GATEWAY], url, config, runner)
    await runner.cleanup()
