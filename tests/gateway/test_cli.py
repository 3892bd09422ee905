"""`keepstate gateway` as a real process sharing its database; `keepstate ledger` and `ledger reconcile`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import sqlalchemy as sa
from click.testing import CliRunner

from keepstate.cli.ledger import ledger
from keepstate.testing import FakeProvider

from .conftest import Env, standalone_gateway


async def test_standalone_gateway_process_and_ledger_commands(fake: FakeProvider, tmp_path: Path) -> None:
    async with standalone_gateway(fake, tmp_path, stats_url=fake.stats_url) as gw:
        # The lead registers runs from its own process, on the shared file.
        token = await gw.lead.register_run("cli-session", "sbx", None, None)
        oa = openai.AsyncOpenAI(base_url=gw.lead.sandbox_env(token, gw.url)["OPENAI_BASE_URL"],
                                api_key=token, max_retries=0)
        async with asyncio.timeout(30):
            while True:
                try:
                    r = await oa.chat.completions.create(model="fake-gpt", messages=[{"role": "user", "content": "hi"}])
                    break
                except openai.APIConnectionError:
                    await asyncio.sleep(0.1)
        assert r.choices[0].message.content
        home = gw.home
        runner = CliRunner()
        shown = await asyncio.to_thread(runner.invoke, ledger, ["--json", "--home", str(home), "--session",
                                                                "cli-session"])
        assert shown.exit_code == 0, shown.output
        doc = json.loads(shown.output)
        assert doc["totals"]["upstream_calls"] == 1 and doc["entries"][0]["input_tokens"] == r.usage.prompt_tokens
        table = await asyncio.to_thread(runner.invoke, ledger, ["--home", str(home)])
        assert "1 upstream calls" in table.output
        # In a thread: reconcile reads the fake provider's count, served by this very event loop.
        args = ["reconcile", "--home", str(home), "--config", str(gw.config_path)]
        clean = await asyncio.to_thread(runner.invoke, ledger, args)
        assert clean.exit_code == 0, clean.output
        fake._stats.calls += 1  # the provider now claims a call the ledger never saw
        dirty = await asyncio.to_thread(runner.invoke, ledger, args)
        assert dirty.exit_code == 1 and "provider" in dirty.output and "calls: ledger 1, provider 2" in dirty.output


def test_ledger_without_a_database_says_where_it_looked(tmp_path: Path) -> None:
    result = CliRunner().invoke(ledger, ["--home", str(tmp_path / "none")])
    assert result.exit_code == 3 and "error: no gateway ledger" in result.stderr


async def test_reconcile_reports_usage_that_disagrees_with_stored_response(env: Env) -> None:
    token = await env.token()
    await env.post(token, "/v1/chat/completions", {"model": "fake-gpt", "messages": [{"role": "user", "content": "a"}]})
    async with env.db.transaction() as conn:
        await conn.execute(sa.text("UPDATE ledger SET output_tokens = output_tokens + 1"))
    result = await asyncio.to_thread(CliRunner().invoke, ledger,
                                     ["reconcile", "--json", "--home", str(env.config.data_dir)])
    assert result.exit_code == 1
    assert [m["check"] for m in json.loads(result.output)] == ["usage"]
