"""Pure logic: call keys, SSE splitting, usage mapping, prices, worst cases, request building."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from keepstate.gateway import budget, callkey, providers, usage
from keepstate.gateway.config import ConfigError, GatewayConfig, ProviderConfig
from keepstate.gateway.prices import PriceTable, PriceTableError
from keepstate.gateway.sse import SseSplitter, split_all


def test_body_hash_ignores_key_order_but_not_content_or_endpoint() -> None:
    a = callkey.body_hash("chat", {"model": "m", "messages": [1, 2]})
    assert a == callkey.body_hash("chat", {"messages": [1, 2], "model": "m"})
    assert a != callkey.body_hash("chat", {"model": "m", "messages": [2, 1]})
    assert a != callkey.body_hash("responses", {"model": "m", "messages": [1, 2]})


def test_position_keys_combine_session_checkpoint_ordinal_body() -> None:
    base = callkey.position_call_key("s", "c", 0, "h")
    assert base == callkey.position_call_key("s", "c", 0, "h")
    others = {callkey.position_call_key(*v) for v in [("t", "c", 0, "h"), ("s", "d", 0, "h"), ("s", "c", 1, "h"),
                                                       ("s", "c", 0, "i"), ("s", None, 0, "h")]}
    assert base not in others and len(others) == 5
    assert callkey.idempotency_call_key("s", "k") != callkey.idempotency_call_key("t", "k")
    assert [callkey.retry_count(v) for v in (None, "0", "2", "x", "-1")] == [0, 0, 2, 0, 0]


def test_sse_splitter_handles_events_cut_anywhere() -> None:
    stream = b'event: a\ndata: {"x": 1}\n\ndata: [DONE]\r\n\r\n'
    for cut in range(len(stream)):
        sp = SseSplitter()
        events = sp.feed(stream[:cut]) + sp.feed(stream[cut:])
        assert [e.data for e in events] == [b'{"x": 1}', b"[DONE]"] and events[0].event == "a"
        assert b"".join(e.raw for e in events) == stream
    assert [e.data for e in split_all(b"data: 1\n\ndata: 2")] == [b"1", b"2"]


def test_openai_input_includes_cached_anthropic_input_excludes_it() -> None:
    oa = usage.from_response("chat", {"usage": {"prompt_tokens": 100, "completion_tokens": 20,
                                                "prompt_tokens_details": {"cached_tokens": 60},
                                                "completion_tokens_details": {"reasoning_tokens": 5}}})
    assert oa == usage.Usage(100, 20, 60, 0, 5)
    an = usage.from_response("messages", {"usage": {"input_tokens": 40, "output_tokens": 20,
                                                    "cache_read_input_tokens": 60, "cache_creation_input_tokens": 10}})
    assert an == usage.Usage(110, 20, 60, 10, 0)
    assert usage.from_response("responses", {"usage": {"input_tokens": 9, "output_tokens": 3,
                                                       "input_tokens_details": {"cached_tokens": 4}}}) == \
        usage.Usage(9, 3, 4, 0, 0)
    assert usage.from_response("embeddings", {"usage": {"prompt_tokens": 7, "total_tokens": 7}}) == usage.Usage(7)
    assert usage.from_response("chat", {"choices": []}) is None


def test_stream_usage_anthropic_merges_start_and_delta() -> None:
    body = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":5,'
            b'"cache_read_input_tokens":3,"output_tokens":1}}}\n\n'
            b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":9}}\n\n')
    assert usage.from_stream("messages", body) == usage.Usage(8, 9, 3, 0, 0)
    chat = b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2}}\n\ndata: [DONE]\n\n'
    assert usage.from_stored("chat", True, chat) == usage.Usage(4, 2)


def test_prices_exact_beats_longest_pattern_and_override(tmp_path: Path) -> None:
    table = PriceTable.load()
    assert table.price("gpt-4o-mini") == table.price("gpt-4o-mini-2024-07-18")
    assert table.price("gpt-4o-2024-08-06") == table.price("gpt-4o")
    assert table.price("unknown-model") is None
    cost = table.cost_nano("claude-sonnet-4-5", usage.Usage(1_000_000, 1_000_000, 500_000, 100_000))
    assert cost == round((400_000 * 3 + 500_000 * 0.3 + 100_000 * 3.75 + 1_000_000 * 15) * 1000)
    override = tmp_path / "p.json"
    override.write_text(json.dumps({"version": 1, "models": {"gpt-4o": {"input": 1, "output": 1}}}))
    assert PriceTable.load(override).cost_nano("gpt-4o", usage.Usage(10, 10)) == 20_000
    override.write_text('{"models": {}}')
    with pytest.raises(PriceTableError, match="version"):
        PriceTable.load(override)


def test_worst_case_bounds_and_cap() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}], "n": 2}
    w = budget.worst_case("chat", body, 100, 50)
    assert (w.input_tokens, w.output_tokens, w.cap_field) == (100 + budget.IMAGE_TOKENS, 100, "max_completion_tokens")
    w = budget.worst_case("messages", {"max_tokens": 7}, 10, 50)
    assert (w.output_tokens, w.cap_field) == (7, None)
    assert budget.worst_case("embeddings", {"input": "x"}, 10, 50).output_tokens == 0


def test_upstream_request_asks_for_stream_usage_and_caps() -> None:
    p = ProviderConfig("p", "openai", "http://127.0.0.1:1/v1", "sk", ("*",))
    body = {"model": "m", "stream": True, "messages": []}
    req = providers.build(p, "chat", body, b"raw", {"openai-beta": "x", "authorization": "Bearer tok"}, True,
                          "max_completion_tokens", 32)
    sent = json.loads(req.body)
    assert sent["stream_options"] == {"include_usage": True} and sent["max_completion_tokens"] == 32
    assert req.hide_usage_chunk and req.headers["authorization"] == "Bearer sk" and req.headers["openai-beta"] == "x"
    plain = providers.build(p, "chat", {"model": "m"}, b"raw", {}, False, None, 0)
    assert plain.body == b"raw" and not plain.hide_usage_chunk
    a = ProviderConfig("a", "anthropic", "http://127.0.0.1:1", "sk-a", ("*",))
    areq = providers.build(a, "messages", {"model": "m"}, b"raw", {}, True, None, 0)
    assert areq.url.endswith("/v1/messages") and areq.headers["x-api-key"] == "sk-a"
    assert areq.headers["anthropic-version"] == providers.DEFAULT_ANTHROPIC_VERSION


def test_config_from_toml_and_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KS_TEST_KEY", "sk-env")
    (tmp_path / "g.toml").write_text(
        'data_dir = "data"\n[[providers]]\nname = "o"\nkind = "openai"\nbase_url = "http://127.0.0.1:1/v1/"\n'
        'api_key_env = "KS_TEST_KEY"\nmodels = ["gpt-*"]\n[budgets]\nkeys = { k1 = 2.5 }\n')
    cfg = GatewayConfig.from_file(tmp_path / "g.toml")
    assert cfg.data_dir == tmp_path / "data" and cfg.providers[0].api_key == "sk-env"
    assert cfg.providers[0].api_key_env == "KS_TEST_KEY"
    cfg.forget_key_variables()  # what the server does once it has read its config
    assert "KS_TEST_KEY" not in os.environ and cfg.providers[0].api_key == "sk-env"
    assert cfg.providers[0].base_url == "http://127.0.0.1:1/v1" and cfg.key_budgets_usd == {"k1": 2.5}
    assert cfg.provider_for("openai", "gpt-x") is not None and cfg.provider_for("anthropic", "gpt-x") is None
    (tmp_path / "g.json").write_text(json.dumps({"providers": [{"name": "a", "kind": "other", "base_url": "x"}]}))
    with pytest.raises(ConfigError, match="kind"):
        GatewayConfig.from_file(tmp_path / "g.json")
