"""Fixtures: a real fake provider and a real gateway, both on 127.0.0.1 with free ports, state in tmp dirs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
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

    async def post(self, token: str, path: str, body: dict[str, Any], **headers: str) -> tuple[int, dict[str, str], bytes]:
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
