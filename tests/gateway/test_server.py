"""The official SDKs, unchanged, through the gateway; errors in each provider's shape."""

from __future__ import annotations

import anthropic
import openai
import pytest

from keepstate.db.errors import DatabaseUnavailable
from keepstate.testing import Fault

from .conftest import Env

MSG = [{"role": "user", "content": "tell me about otters"}]


def clients(env: Env, token: str) -> tuple[openai.AsyncOpenAI, anthropic.AsyncAnthropic]:
    e = env.gateway.sandbox_env(token, env.url)
    return (openai.AsyncOpenAI(base_url=e["OPENAI_BASE_URL"], api_key=e["OPENAI_API_KEY"], max_retries=0),
            anthropic.AsyncAnthropic(base_url=e["ANTHROPIC_BASE_URL"], api_key=e["ANTHROPIC_API_KEY"], max_retries=0))


async def test_sandbox_env_points_at_gateway(env: Env) -> None:
    token = await env.token()
    e = env.gateway.sandbox_env(token, env.url + "/")
    assert e == {"OPENAI_BASE_URL": env.url + "/v1", "OPENAI_API_KEY": token, "ANTHROPIC_BASE_URL": env.url,
                 "ANTHROPIC_API_KEY": token}
    assert "sk-host" not in "".join(e.values())


async def test_openai_chat_plain_and_stream(env: Env) -> None:
    oa, _ = clients(env, await env.token())
    r = await oa.chat.completions.create(model="fake-gpt", messages=MSG)
    assert r.choices[0].message.content and r.usage is not None and r.usage.prompt_tokens == 7
    chunks = [c async for c in await oa.chat.completions.create(model="fake-gpt", messages=MSG, stream=True)]
    # The client did not ask for usage: the usage chunk the gateway asked for is not shown to it.
    assert all(c.choices for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text
    with_usage = [c async for c in await oa.chat.completions.create(
        model="fake-gpt", messages=MSG, stream=True, stream_options={"include_usage": True})]
    assert with_usage[-1].usage is not None and with_usage[-1].choices == []
    entries = await env.gateway.ledger.entries()
    assert [e["kind"] for e in entries] == ["upstream"] * 3
    assert all(e["output_tokens"] > 0 and e["input_tokens"] == 7 for e in entries)
    assert entries[1]["output_tokens"] == len(text.split())


async def test_openai_responses_and_embeddings(env: Env) -> None:
    oa, _ = clients(env, await env.token())
    r = await oa.responses.create(model="fake-gpt", input="hello world", reasoning={"effort": "low"})
    assert r.output_text and r.usage is not None and r.usage.output_tokens_details.reasoning_tokens == 5
    events = [e async for e in await oa.responses.create(model="fake-gpt", input="hello", stream=True)]
    assert events[-1].type == "response.completed"
    emb = await oa.embeddings.create(model="fake-embed", input=["a b c", "d"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 8
    entries = await env.gateway.ledger.entries()
    assert [e["endpoint"] for e in entries] == ["responses", "responses", "embeddings"]
    assert entries[0]["reasoning_tokens"] == 5 and entries[1]["output_tokens"] > 0
    assert entries[2]["input_tokens"] == 4 and entries[2]["output_tokens"] == 0


async def test_anthropic_plain_and_stream_with_cache_tokens(env: Env) -> None:
    _, an = clients(env, await env.token())
    system = [{"type": "text", "text": "one two three four five six", "cache_control": {"type": "ephemeral"}}]
    m = await an.messages.create(model="claude-fake-1", max_tokens=64, system=system, messages=MSG)
    assert m.content[0].text and m.usage.cache_read_input_tokens == 6
    async with an.messages.stream(model="claude-fake-1", max_tokens=64, messages=MSG) as s:
        text = "".join([t async for t in s.text_stream])
        final = await s.get_final_message()
    assert text and final.usage.output_tokens == len(text.split())
    e1, e2 = await env.gateway.ledger.entries()
    # Anthropic's input excludes cache reads; the ledger's input includes them.
    assert e1["input_tokens"] == m.usage.input_tokens + 6 and e1["cached_tokens"] == 6
    assert e1["cost_nano"] == round(((e1["input_tokens"] - 6) * 3.0 + 6 * 0.3 + e1["output_tokens"] * 15.0) * 1000)
    assert e2["output_tokens"] == final.usage.output_tokens


async def test_models_listing_in_both_shapes(env: Env) -> None:
    oa, an = clients(env, await env.token())
    env.config.providers[0] = env.config.providers[0].__class__(
        "fake-openai", "openai", env.fake.openai_base_url, "k", ("fake-gpt", "fake-*"))
    assert [m.id async for m in oa.models.list()] == ["fake-gpt"]
    assert [m.id async for m in an.models.list()] == []


async def test_errors_have_provider_shapes(env: Env) -> None:
    token = await env.token()
    oa, an = clients(env, token)
    with pytest.raises(openai.NotFoundError) as nf:
        await oa.chat.completions.create(model="nope", messages=MSG)
    assert nf.value.code == "model_not_found"
    with pytest.raises(anthropic.NotFoundError) as anf:
        await an.messages.create(model="nope", max_tokens=5, messages=MSG)
    assert anf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    bad_oa = openai.AsyncOpenAI(base_url=env.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad_oa.chat.completions.create(model="fake-gpt", messages=MSG)
    status, _, body = await env.post(token, "/v1/chat/completions", {}, **{"content-type": "application/json"})
    assert status == 400 and b'"param": "model"' in body
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.post(env.url + "/v1/messages", data=b"{not json", headers={"x-api-key": token}) as r:
            assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
    assert env.fake.stats().requests == 0


async def test_upstream_error_and_timeout(env: Env) -> None:
    oa, an = clients(env, await env.token())
    env.fake.inject(Fault(status=500))
    with pytest.raises(openai.InternalServerError):
        await oa.chat.completions.create(model="fake-gpt", messages=MSG)
    env.fake.inject(Fault(status=529))
    with pytest.raises(anthropic.APIStatusError) as e:
        await an.messages.create(model="claude-fake-1", max_tokens=5, messages=MSG)
    assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    env.fake.inject(Fault(hang=True))
    with pytest.raises(openai.APIStatusError) as t:
        await oa.chat.completions.create(model="fake-gpt", messages=[{"role": "user", "content": "slow"}])
    assert t.value.status_code == 504 and t.value.code == "upstream_timeout"
    outcomes = [e["outcome"] for e in await env.gateway.ledger.entries()]
    assert outcomes == ["error", "error", "timeout"]
    # A failed call is tried upstream again on the next request with its key.
    r = await oa.chat.completions.create(model="fake-gpt", messages=[{"role": "user", "content": "slow"}],
                                         extra_headers={"x-stainless-retry-count": "1"})
    assert r.choices[0].message.content
    assert env.fake.stats().calls == 1


async def test_mid_stream_failure_cuts_client_off(env: Env) -> None:
    oa, _ = clients(env, await env.token())
    env.fake.inject(Fault(break_after=2))
    got: list[str] = []
    with pytest.raises(openai.APIError):
        async for c in await oa.chat.completions.create(model="fake-gpt", messages=MSG, stream=True):
            got.append(c.choices[0].delta.content or "")
    assert len([g for g in got if g]) == 2
    (entry,) = await env.gateway.ledger.entries()
    assert entry["outcome"] == "broken" and env.fake.stats().calls == 0


async def test_a_database_that_does_not_answer_is_a_retryable_503(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    token = await env.token()

    async def down(*_: object) -> None:
        raise DatabaseUnavailable("sqlite:///x: disk I/O error")

    monkeypatch.setattr(env.gateway.ledger, "caller", down)  # the read that authenticates every call
    oa = openai.AsyncOpenAI(base_url=env.url + "/v1", api_key=token, max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        await oa.chat.completions.create(model="fake-gpt", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 503 and e.value.code == "database_unavailable"
    assert e.value.response.headers["retry-after"] == "2" and e.value.response.headers["x-should-retry"] == "true"
    assert env.fake.stats().requests == 0
