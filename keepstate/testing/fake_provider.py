"""A fake model provider, OpenAI- and Anthropic-compatible, for tests and benchmarks.

Deterministic: the answer depends only on the request body. It streams (SSE) or not, waits as configured before
the first token and between chunks, injects faults (error statuses, hangs, streams broken mid-way), and keeps its
own bill: the calls and tokens it served, in Python (`stats()`) and over HTTP (`GET /_fake/stats`).

Scripted tool calls (`tool_script`, for agent loops such as examples/computer_use.py): a Chat Completions request
that offers `tools` and holds N assistant messages gets the script's Nth call, `{"name": ..., "arguments": {...}}`,
as its one `tool_calls` entry (non-streamed); past the script's end, the usual text answer. Still a function of
the body alone, so a retried or replayed call gets the same answer.

    async with FakeProvider() as fake:
        client = openai.AsyncOpenAI(base_url=fake.openai_base_url, api_key="x")

    python -m keepstate.testing.fake_provider --port 8999 [--first-token-ms 0] [--chunk-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

import blake3
from aiohttp import web

VOCABULARY = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
    "romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()
REASONING_TOKENS = 5
EMBEDDING_DIMS = 8


@dataclass
class Fault:
    """What the next matching request gets instead of a normal answer."""

    status: int | None = None  # answer with this HTTP status and the provider's error shape
    hang: bool = False  # never answer (until the server stops)
    break_after: int | None = None  # stream: cut the connection after this many content chunks
    endpoint: str | None = None  # only requests to this endpoint (chat, responses, embeddings, messages)


@dataclass
class Served:
    """One line of the fake provider's bill."""

    request_id: str
    endpoint: str
    model: str
    stream: bool
    status: int
    billed: bool
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass
class Stats:
    requests: int = 0
    calls: int = 0  # billed calls: answered in full with 200
    input_tokens: int = 0  # all input, cached included
    output_tokens: int = 0  # all output, reasoning included
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    served: list[Served] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Answer:
    text_tokens: list[str]
    input_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    stop: str  # "stop" or "length"

    @property
    def output_tokens(self) -> int:
        return len(self.text_tokens) + self.reasoning_tokens


class FakeProvider:
    def __init__(
        self, first_token_s: float = 0.0, chunk_s: float = 0.0, api_key: str | None = None, port: int = 0,
        host: str = "127.0.0.1", tool_script: list[dict[str, Any]] | None = None,
    ) -> None:
        self.first_token_s, self.chunk_s, self.api_key = first_token_s, chunk_s, api_key
        self.tool_script = list(tool_script or [])
        self.host, self.port = host, port
        self.faults: list[Fault] = []
        self._stats = Stats()
        self._runner: web.AppRunner | None = None
        self._next_id = 0

    # --- lifecycle -----------------------------------------------------------------------------------------------

    async def start(self) -> FakeProvider:
        self._runner = web.AppRunner(self.app(), handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeProvider:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def openai_base_url(self) -> str:
        return self.url + "/v1"

    @property
    def anthropic_base_url(self) -> str:
        return self.url

    @property
    def stats_url(self) -> str:
        return self.url + "/_fake/stats"

    def stats(self) -> Stats:
        return self._stats

    def reset(self) -> None:
        self._stats = Stats()
        self.faults.clear()

    def inject(self, fault: Fault, times: int = 1) -> None:
        self.faults.extend([fault] * times)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        for path, endpoint in (
            ("/v1/chat/completions", "chat"), ("/v1/responses", "responses"), ("/v1/embeddings", "embeddings"),
            ("/v1/messages", "messages"),
        ):
            app.router.add_post(path, self._handler(endpoint))
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/_fake/stats", self._http_stats)
        app.router.add_post("/_fake/reset", self._http_reset)
        app.router.add_post("/_fake/faults", self._http_faults)
        return app

    # --- HTTP ----------------------------------------------------------------------------------------------------

    def _take_fault(self, endpoint: str) -> Fault | None:
        for i, f in enumerate(self.faults):
            if f.endpoint is None or f.endpoint == endpoint:
                return self.faults.pop(i)
        return None

    def _handler(self, endpoint: str) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._serve(request, endpoint)

        return handle

    async def _serve(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        self._stats.requests += 1
        self._next_id += 1
        rid = f"req_fake_{self._next_id:06d}"
        anthropic = endpoint == "messages"
        rid_header = {"request-id" if anthropic else "x-request-id": rid}
        if self.api_key is not None:
            got = request.headers.get("x-api-key") if anthropic else request.headers.get("authorization")
            if got not in (self.api_key, f"Bearer {self.api_key}"):
                return self._error(request, endpoint, rid, 401, "authentication", "invalid x-api-key")
        raw = await request.read()
        try:
            body = json.loads(raw)
            model = body["model"]
            assert isinstance(body, dict) and isinstance(model, str)
        except (ValueError, KeyError, TypeError, AssertionError):
            return self._error(request, endpoint, rid, 400, "invalid_request", "bad JSON body or no model")
        stream = endpoint != "embeddings" and body.get("stream") is True
        fault = self._take_fault(endpoint)
        if fault is not None and fault.hang:
            await asyncio.sleep(3600)
        if fault is not None and fault.status is not None:
            return self._error(request, endpoint, rid, fault.status, "injected", f"injected status {fault.status}",
                               model=model)
        answer = _answer(endpoint, body, raw)
        if self.first_token_s:
            await asyncio.sleep(self.first_token_s)
        break_after = fault.break_after if fault is not None else None
        if endpoint == "embeddings":
            return self._bill_json(rid, endpoint, model, answer, _embeddings(body, answer), rid_header)
        if not stream:
            if break_after is not None:
                self._log(Served(rid, endpoint, model, False, 200, False))
                assert request.transport is not None
                request.transport.abort()
                return web.Response()
            call = self._scripted(endpoint, body)
            doc = _chat_tool_call(rid, model, answer, call) if call else _RENDER[endpoint](rid, model, answer)
            return self._bill_json(rid, endpoint, model, answer, doc, rid_header)
        return await self._stream(request, rid, endpoint, model, body, answer, break_after, rid_header)

    def _scripted(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The tool call the script holds for this conversation's turn (its count of assistant messages), if any."""
        if endpoint != "chat" or not self.tool_script or not body.get("tools"):
            return None
        messages = body.get("messages")
        turn = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant") \
            if isinstance(messages, list) else 0
        return self.tool_script[turn] if turn < len(self.tool_script) else None

    def _bill_json(
        self, rid: str, endpoint: str, model: str, a: _Answer, doc: dict[str, Any], headers: dict[str, str]
    ) -> web.Response:
        self._bill(rid, endpoint, model, False, a)
        return web.json_response(doc, headers=headers)

    def _bill(self, rid: str, endpoint: str, model: str, stream: bool, a: _Answer) -> None:
        out = 0 if endpoint == "embeddings" else a.output_tokens
        s = Served(rid, endpoint, model, stream, 200, True, a.input_tokens, out, a.cached_tokens,
                   0 if endpoint == "embeddings" else a.reasoning_tokens)
        st = self._stats
        st.calls += 1
        st.input_tokens += s.input_tokens
        st.output_tokens += s.output_tokens
        st.cached_tokens += s.cached_tokens
        st.reasoning_tokens += s.reasoning_tokens
        st.served.append(s)

    def _log(self, s: Served) -> None:
        self._stats.served.append(s)

    async def _stream(
        self, request: web.Request, rid: str, endpoint: str, model: str, body: dict[str, Any], a: _Answer,
        break_after: int | None, headers: dict[str, str],
    ) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={**headers, "content-type": "text/event-stream"})
        events = _STREAMS[endpoint](rid, model, body, a)
        # Bill up front: a provider charges a call it has decided to answer, whether or not the client stays.
        if break_after is None:
            self._bill(rid, endpoint, model, True, a)
        else:
            self._log(Served(rid, endpoint, model, True, 200, False))
        await resp.prepare(request)
        content = 0
        for ev, is_content in events:
            if is_content:
                if break_after is not None and content >= break_after:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                content += 1
                if self.chunk_s and content > 1:
                    await asyncio.sleep(self.chunk_s)
            try:
                await resp.write(ev)
            except ConnectionError:
                return resp
        await resp.write_eof()
        return resp

    def _error(
        self, request: web.Request, endpoint: str, rid: str, status: int, kind: str, message: str, model: str = ""
    ) -> web.Response:
        self._log(Served(rid, endpoint, model, False, status, False))
        if endpoint == "messages":
            an_type = {400: "invalid_request_error", 401: "authentication_error", 429: "rate_limit_error",
                       529: "overloaded_error"}.get(status, "api_error")
            doc: dict[str, Any] = {"type": "error", "error": {"type": an_type, "message": message}}
            return web.json_response(doc, status=status, headers={"request-id": rid})
        oa_type = "invalid_request_error" if status < 500 else "server_error"
        doc = {"error": {"message": message, "type": oa_type, "param": None, "code": kind}}
        return web.json_response(doc, status=status, headers={"x-request-id": rid})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-gpt", "object": "model", "created": 0,
                                                               "owned_by": "fake"}]})

    async def _http_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self._stats.to_dict())

    async def _http_reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response({"ok": True})

    async def _http_faults(self, request: web.Request) -> web.Response:
        doc = await request.json()
        for f in doc.get("faults", []):
            self.inject(Fault(**{k: v for k, v in f.items() if k != "times"}), int(f.get("times", 1)))
        return web.json_response({"queued": len(self.faults)})


# --- deterministic answers (pure) ----------------------------------------------------------------------------------


def _texts(node: Any) -> list[str]:
    """Every prompt string in a request body: message contents, instructions, inputs."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [t for v in node for t in _texts(v)]
    if isinstance(node, dict):
        out: list[str] = []
        for k in ("content", "text", "input", "instructions", "system", "messages", "prompt"):
            if k in node:
                out += _texts(node[k])
        return out
    return []


def _count_messages(body: dict[str, Any]) -> int:
    msgs = body.get("messages")
    if isinstance(msgs, list):
        return len(msgs)
    return 1


def _has_key(node: Any, key: str) -> bool:
    if isinstance(node, dict):
        return key in node or any(_has_key(v, key) for v in node.values())
    if isinstance(node, list):
        return any(_has_key(v, key) for v in node)
    return False


def _answer(endpoint: str, body: dict[str, Any], raw: bytes) -> _Answer:
    digest = blake3.blake3(raw).digest()
    words = sum(len(t.split()) for t in _texts({k: v for k, v in body.items() if k != "model"}))
    input_tokens = words + (0 if endpoint == "embeddings" else 3 * _count_messages(body))
    cached = input_tokens // 2 if (_has_key(body, "cache_control") or "prompt_cache_key" in body) else 0
    reasoning = REASONING_TOKENS if ("reasoning_effort" in body or "reasoning" in body) else 0
    wanted = 4 + digest[0] % 9
    limit = next((body[k] for k in ("max_completion_tokens", "max_tokens", "max_output_tokens")
                  if isinstance(body.get(k), int)), None)
    stop = "stop"
    if limit is not None and wanted + reasoning > limit:
        wanted, reasoning, stop = max(0, limit - min(reasoning, limit)), min(reasoning, limit), "length"
    tokens = [VOCABULARY[b % len(VOCABULARY)] for b in digest[1 : 1 + wanted]]
    return _Answer([("" if i == 0 else " ") + w for i, w in enumerate(tokens)], input_tokens, cached, reasoning, stop)


def _openai_usage(a: _Answer) -> dict[str, Any]:
    return {
        "prompt_tokens": a.input_tokens, "completion_tokens": a.output_tokens,
        "total_tokens": a.input_tokens + a.output_tokens,
        "prompt_tokens_details": {"cached_tokens": a.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": a.reasoning_tokens},
    }


def _responses_usage(a: _Answer) -> dict[str, Any]:
    return {
        "input_tokens": a.input_tokens, "output_tokens": a.output_tokens,
        "total_tokens": a.input_tokens + a.output_tokens,
        "input_tokens_details": {"cached_tokens": a.cached_tokens},
        "output_tokens_details": {"reasoning_tokens": a.reasoning_tokens},
    }


def _anthropic_usage(a: _Answer, output: int) -> dict[str, Any]:
    # Anthropic's input_tokens excludes cache reads and writes.
    return {"input_tokens": a.input_tokens - a.cached_tokens, "output_tokens": output,
            "cache_read_input_tokens": a.cached_tokens, "cache_creation_input_tokens": 0}


def _chat(rid: str, model: str, a: _Answer) -> dict[str, Any]:
    return {
        "id": "chatcmpl-" + rid, "object": "chat.completion", "created": 0, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(a.text_tokens), "refusal": None},
                     "finish_reason": a.stop, "logprobs": None}],
        "usage": _openai_usage(a),
    }


def _chat_tool_call(rid: str, model: str, a: _Answer, call: dict[str, Any]) -> dict[str, Any]:
    doc = _chat(rid, model, a)
    arguments = call.get("arguments", {})
    doc["choices"][0]["message"].update(content=None, tool_calls=[{
        "id": "call_" + rid, "type": "function",
        "function": {"name": str(call["name"]),
                     "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)},
    }])
    doc["choices"][0]["finish_reason"] = "tool_calls"
    return doc


def _message_item(rid: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": "msg_" + rid, "status": status, "role": "assistant", "content": content}


def _response(rid: str, model: str, a: _Answer | None) -> dict[str, Any]:
    return {
        "id": "resp_" + rid, "object": "response", "created_at": 0, "model": model,
        "status": ("completed" if a.stop == "stop" else "incomplete") if a is not None else "in_progress",
        "output": [_message_item(rid, "".join(a.text_tokens), "completed")] if a is not None else [],
        "usage": _responses_usage(a) if a is not None else None,
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "error": None,
        "incomplete_details": None if a is None or a.stop == "stop" else {"reason": "max_output_tokens"},
    }


def _message(rid: str, model: str, a: _Answer) -> dict[str, Any]:
    return {
        "id": "msg_" + rid, "type": "message", "role": "assistant", "model": model,
        "content": [{"type": "text", "text": "".join(a.text_tokens)}],
        "stop_reason": "end_turn" if a.stop == "stop" else "max_tokens", "stop_sequence": None,
        "usage": _anthropic_usage(a, a.output_tokens),
    }


def _embeddings(body: dict[str, Any], a: _Answer) -> dict[str, Any]:
    inputs = body.get("input")
    items = inputs if isinstance(inputs, list) and inputs and not isinstance(inputs[0], int) else [inputs]
    data = []
    for i, item in enumerate(items):
        d = blake3.blake3(json.dumps(item).encode()).digest()
        vec = [(b - 128) / 128 for b in d[:EMBEDDING_DIMS]]
        emb: Any = vec
        if body.get("encoding_format") == "base64":
            emb = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return {"object": "list", "data": data, "model": body["model"],
            "usage": {"prompt_tokens": a.input_tokens, "total_tokens": a.input_tokens}}


_RENDER = {"chat": _chat, "responses": lambda rid, model, a: _response(rid, model, a), "messages": _message}


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return (head + "data: " + (data if isinstance(data, str) else json.dumps(data)) + "\n\n").encode()


def _chat_stream(rid: str, model: str, body: dict[str, Any], a: _Answer) -> list[tuple[bytes, bool]]:
    usage_on = bool((body.get("stream_options") or {}).get("include_usage"))
    base = {"id": "chatcmpl-" + rid, "object": "chat.completion.chunk", "created": 0, "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        doc: dict[str, Any] = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                                    "logprobs": None}]}
        if usage_on:
            doc["usage"] = None
        return _sse(doc)

    out = [(chunk({"role": "assistant", "content": ""}), False)]
    out += [(chunk({"content": t}), True) for t in a.text_tokens]
    out.append((chunk({}, a.stop), False))
    if usage_on:
        out.append((_sse({**base, "choices": [], "usage": _openai_usage(a)}), False))
    out.append((_sse("[DONE]"), False))
    return out


def _responses_stream(rid: str, model: str, body: dict[str, Any], a: _Answer) -> list[tuple[bytes, bool]]:
    seq = iter(range(1_000_000))
    item_id, text = "msg_" + rid, "".join(a.text_tokens)

    def ev(kind: str, **fields: Any) -> bytes:
        return _sse({"type": kind, "sequence_number": next(seq), **fields}, kind)

    part = {"type": "output_text", "text": "", "annotations": []}
    loc = {"item_id": item_id, "output_index": 0, "content_index": 0}
    out = [
        (ev("response.created", response=_response(rid, model, None)), False),
        (ev("response.output_item.added", output_index=0, item=_message_item(rid, "", "in_progress")), False),
        (ev("response.content_part.added", **loc, part=part), False),
    ]
    out += [(ev("response.output_text.delta", **loc, delta=t, logprobs=[]), True) for t in a.text_tokens]
    final = _response(rid, model, a)
    out += [
        (ev("response.output_text.done", **loc, text=text, logprobs=[]), False),
        (ev("response.content_part.done", **loc, part={**part, "text": text}), False),
        (ev("response.output_item.done", output_index=0, item=_message_item(rid, text, "completed")), False),
        (ev("response.completed" if a.stop == "stop" else "response.incomplete", response=final), False),
    ]
    return out


def _messages_stream(rid: str, model: str, body: dict[str, Any], a: _Answer) -> list[tuple[bytes, bool]]:
    start = {**_message(rid, model, a), "content": [], "stop_reason": None, "usage": _anthropic_usage(a, 1)}
    out = [
        (_sse({"type": "message_start", "message": start}, "message_start"), False),
        (_sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
              "content_block_start"), False),
        (_sse({"type": "ping"}, "ping"), False),
    ]
    out += [(_sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}},
                  "content_block_delta"), True) for t in a.text_tokens]
    out += [
        (_sse({"type": "content_block_stop", "index": 0}, "content_block_stop"), False),
        (_sse({"type": "message_delta", "delta": {"stop_reason": "end_turn" if a.stop == "stop" else "max_tokens",
                                                  "stop_sequence": None},
               "usage": {"output_tokens": a.output_tokens}}, "message_delta"), False),
        (_sse({"type": "message_stop"}, "message_stop"), False),
    ]
    return out


_STREAMS = {"chat": _chat_stream, "responses": _responses_stream, "messages": _messages_stream}


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the KeepState fake model provider on 127.0.0.1.")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--first-token-ms", type=float, default=0.0)
    parser.add_argument("--chunk-ms", type=float, default=0.0)
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()

    async def serve() -> None:
        fake = FakeProvider(args.first_token_ms / 1000, args.chunk_ms / 1000, args.api_key, args.port, args.host)
        await fake.start()
        print(f"fake provider listening on {fake.url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await fake.stop()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
