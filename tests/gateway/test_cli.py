"""`keepstate gateway` as a real process sharing its SQLite file; `keepstate ledger` and `ledger reconcile`."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

import openai
from click.testing import CliRunner

from keepstate.cli.ledger import ledger
from keepstate.gateway import Gateway, GatewayConfig
from keepstate.testing import FakeProvider

from .conftest import Env

HOST_KEY = "sk-host-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_standalone_gateway_process_and_ledger_commands(fake: FakeProvider, tmp_path: Path) -> None:
    cfg_path = tmp_path / "gateway.json"
    cfg_path.write_text(json.dumps({
        "providers": [{"name": "fake", "kind": "openai", "base_url": fake.openai_base_url, "api_key": HOST_KEY,
                       "models": ["fake-*"], "stats_url": fake.stats_url}],
        "price_table": str(tmp_path / "prices.json"),
    }))
    (tmp_path / "prices.json").write_text(json.dumps({"version": 1, "models": {"fake-*": {"input": 1, "output": 2}}}))
    home = tmp_path / "home"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "keepstate.cli.main", "gateway", "--listen", f"127.0.0.1:{port}",
                             "--config", str(cfg_path), "--home", str(home)], stderr=subprocess.PIPE)
    try:
        # The lead registers runs from its own process, on the shared file.
        cfg = GatewayConfig.from_file(cfg_path)
        cfg.data_dir = home
        lead = Gateway(cfg)
        token = lead.register_run("cli-session", "sbx", None, None)
        oa = openai.AsyncOpenAI(base_url=lead.sandbox_env(token, f"http://127.0.0.1:{port}")["OPENAI_BASE_URL"],
                                api_key=token, max_retries=0)
        async with asyncio.timeout(30):
            while True:
                try:
                    r = await oa.chat.completions.create(model="fake-gpt", messages=[{"role": "user", "content": "hi"}])
                    break
                except openai.APIConnectionError:
                    await asyncio.sleep(0.1)
        assert r.choices[0].message.content
        runner = CliRunner()
        shown = runner.invoke(ledger, ["--json", "--home", str(home), "--session", "cli-session"])
        assert shown.exit_code == 0, shown.output
        doc = json.loads(shown.output)
        assert doc["totals"]["upstream_calls"] == 1 and doc["entries"][0]["input_tokens"] == r.usage.prompt_tokens
        table = runner.invoke(ledger, ["--home", str(home)])
        assert "1 upstream calls" in table.output
        # In a thread: reconcile reads the fake provider's count, served by this very event loop.
        args = ["reconcile", "--home", str(home), "--config", str(cfg_path)]
        clean = await asyncio.to_thread(runner.invoke, ledger, args)
        assert clean.exit_code == 0, clean.output
        fake._stats.calls += 1  # the provider now claims a call the ledger never saw
        dirty = await asyncio.to_thread(runner.invoke, ledger, args)
        assert dirty.exit_code == 1 and "provider" in dirty.output and "calls: ledger 1, provider 2" in dirty.output
        lead.store.close()
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_ledger_without_a_database_says_where_it_looked(tmp_path: Path) -> None:
    result = CliRunner().invoke(ledger, ["--home", str(tmp_path / "none")])
    assert result.exit_code == 1 and "no gateway ledger" in result.output


async def test_reconcile_reports_usage_that_disagrees_with_stored_response(env: Env) -> None:
    token = env.token()
    await env.post(token, "/v1/chat/completions", {"model": "fake-gpt", "messages": [{"role": "user", "content": "a"}]})
    env.gateway.store.db.execute("UPDATE ledger SET output_tokens = output_tokens + 1")
    result = CliRunner().invoke(ledger, ["reconcile", "--json", "--home", str(env.config.data_dir)])
    assert result.exit_code == 1
    assert [m["check"] for m in json.loads(result.output)] == ["usage"]
