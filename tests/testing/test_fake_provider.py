"""The fake provider: deterministic, both API shapes, streaming, faults, and its own bill over HTTP."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import urllib.request

import aiohttp
import anthropic
import openai
import pytest

import keepstate.testing
from keepstate.testing import FakeProvider, Fault

MSG = [{"role": "user", "content": "one two three"}]


def test_public_exports_are_pinned() -> None:
    assert keepstate.testing.__all__ == ["FakeProvider", "FakeRuntime", "FakeTemplates", "Fault", "Served", "Stats",
                                         "fake_provider_in_thread", "leftovers"]


async def test_deterministic_answers_and_bill() -> None:
    async with FakeProvider() as fake:
        oa = openai.AsyncOpenAI(base_url=fake.openai_base_url, api_key="x", max_retries=0)
        a = await oa.chat.completions.create(model="m", messages=MSG)
        b = await oa.chat.completions.create(model="m", messages=MSG)
        c = await oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "other"}])
        assert a.choices[0].message.content == b.choices[0].message.content != c.choices[0].message.content
        assert a.usage is not None and a.usage.prompt_tokens == 3 + 3
        streamed = [x async for x in await oa.chat.completions.create(
            model="m", messages=MSG, stream=True, stream_options={"include_usage": True})]
        assert streamed[-1].usage is not None and streamed[-1].usage.prompt_tokens == 6
        capped = await oa.chat.completions.create(model="m", messages=MSG, max_completion_tokens=2)
        assert capped.choices[0].finish_reason == "length" and capped.usage and capped.usage.completion_tokens == 2
        st = fake.stats()
        assert (st.requests, st.calls) == (5, 5)
        assert st.input_tokens == 6 * 4 + 4 and st.output_tokens == sum(
            x.usage.completion_tokens for x in (a, b, c, capped) if x.usage) + streamed[-1].usage.completion_tokens
        async with aiohttp.ClientSession() as s:
            async with s.get(fake.stats_url) as r:
                doc = await r.json()
        assert doc["calls"] == 5 and len(doc["served"]) == 5 and doc["served"][0]["request_id"].startswith("req_")


async def test_anthropic_shape_and_cache_fields() -> None:
    async with FakeProvider() as fake:
        an = anthropic.AsyncAnthropic(base_url=fake.anthropic_base_url, api_key="x", max_retries=0)
        system = [{"type": "text", "text": "a b c d", "cache_control": {"type": "ephemeral"}}]
        m = await an.messages.create(model="c", max_tokens=50, system=system, messages=MSG)
        assert m.usage.cache_read_input_tokens == 5 and m.usage.input_tokens == 10 - 5
        async with an.messages.stream(model="c", max_tokens=50, messages=MSG) as s:
            final = await s.get_final_message()
        assert final.content[0].type == "text" and final.stop_reason == "end_turn"


async def test_faults_over_http_and_python() -> None:
    async with FakeProvider(first_token_s=0.001, chunk_s=0.001) as fake:
        async with aiohttp.ClientSession() as s:
            async with s.post(fake.url + "/_fake/faults", json={"faults": [{"status": 429, "times": 2}]}) as r:
                assert (await r.json())["queued"] == 2
        oa = openai.AsyncOpenAI(base_url=fake.openai_base_url, api_key="x", max_retries=0)
        for _ in range(2):
            with pytest.raises(openai.RateLimitError):
                await oa.chat.completions.create(model="m", messages=MSG)
        fake.inject(Fault(break_after=1))
        with pytest.raises(openai.APIError):
            async for _ in await oa.chat.completions.create(model="m", messages=MSG, stream=True):
                pass
        fake.inject(Fault(hang=True))
        slow = openai.AsyncOpenAI(base_url=fake.openai_base_url, api_key="x", max_retries=0, timeout=0.2)
        with pytest.raises(openai.APITimeoutError):
            await slow.chat.completions.create(model="m", messages=MSG)
        st = fake.stats()
        assert (st.requests, st.calls) == (4, 0)


async def test_requires_the_configured_key() -> None:
    async with FakeProvider(api_key="sk-right") as fake:
        oa = openai.AsyncOpenAI(base_url=fake.openai_base_url, api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await oa.chat.completions.create(model="m", messages=MSG)


async def test_module_entry_point_serves_on_the_given_port() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "keepstate.testing.fake_provider", "--port", str(port)],
                            stdout=subprocess.PIPE)
    try:
        async with asyncio.timeout(30), aiohttp.ClientSession() as s:
            while True:
                try:
                    async with s.get(f"http://127.0.0.1:{port}/_fake/stats") as r:
                        assert json.loads(await r.read())["requests"] == 0
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.1)
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


def test_fake_provider_in_a_thread_serves_synchronous_callers() -> None:
    with keepstate.testing.fake_provider_in_thread() as fake:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
        req = urllib.request.Request(fake.openai_base_url + "/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            doc = json.load(r)
        assert doc["choices"][0]["message"]["content"]
        assert fake.stats().calls == 1
    with pytest.raises(OSError):  # stopped with the block
        urllib.request.urlopen(fake.openai_base_url + "/models", timeout=5)


async def test_scripted_tool_calls_follow_the_conversation() -> None:
    script = [{"name": "computer", "arguments": {"action": "type", "text": "echo hi"}},
              {"name": "computer", "arguments": {"action": "key", "keys": "enter"}}]
    tools = [{"type": "function", "function": {"name": "computer", "parameters": {"type": "object"}}}]
    async with FakeProvider(tool_script=script) as fake:
        oa = openai.AsyncOpenAI(base_url=fake.openai_base_url, api_key="x", max_retries=0)
        first = await oa.chat.completions.create(model="m", messages=MSG, tools=tools)  # type: ignore[arg-type]
        again = await oa.chat.completions.create(model="m", messages=MSG, tools=tools)  # type: ignore[arg-type]
        call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
        assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "computer"  # type: ignore[union-attr]
        assert json.loads(call.function.arguments) == script[0]["arguments"]  # type: ignore[union-attr]
        assert again.choices[0].message.tool_calls[0].function.arguments == call.function.arguments  # type: ignore[index,union-attr]
        turn = [*MSG, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "done"}]
        second = await oa.chat.completions.create(model="m", messages=turn, tools=tools)  # type: ignore[arg-type]
        assert json.loads(second.choices[0].message.tool_calls[0].function.arguments) == {  # type: ignore[index,union-attr]
            "action": "key", "keys": "enter"}
        past = [*turn, {"role": "assistant", "content": "x"}, {"role": "user", "content": "and?"}]
        end = await oa.chat.completions.create(model="m", messages=past, tools=tools)  # type: ignore[arg-type]
        plain = await oa.chat.completions.create(model="m", messages=MSG)
        assert end.choices[0].message.tool_calls is None and end.choices[0].message.content
        assert plain.choices[0].message.tool_calls is None
        assert fake.stats().calls == 5
