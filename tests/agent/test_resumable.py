"""Streams the host's router picks up again after their connection was cut (docs/design/resumable-streams.md).

Over HTTP against a real agent process; the record's limits (expiry, size, a failing handler) in process."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import struct
import time

import pytest

from keepstate.agent.asgi import HTTPError, Message
from keepstate.agent.resumable import Streams
from tests.agent.harness import HOST_ONLY_REASON, REMOTE

host_only = pytest.mark.skipif(REMOTE, reason=HOST_ONLY_REASON)  # the router keeps both the header and the path


def _frames(body: bytes) -> list[tuple[int, dict]]:
    out, i = [], 0
    while i < len(body):
        flags, length = struct.unpack(">BI", body[i : i + 5])
        assert len(body) >= i + 5 + length, f"cut inside a frame at {i}"
        out.append((flags, json.loads(body[i + 5 : i + 5 + length])))
        i += 5 + length
    return out


def _start(cmd: str) -> bytes:
    data = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", cmd]}, "stdin": False}).encode()
    return struct.pack(">BI", 0, len(data)) + data


@host_only
def test_a_cut_stream_is_resumed_from_its_offset_with_nothing_lost(secured) -> None:
    sid = secrets.token_hex(16)
    headers = {"X-Access-Token": secured.token, "Content-Type": "application/connect+json",
               "X-KeepState-Stream": sid}
    cmd = "for i in $(seq 1 40); do echo line-$i; sleep 0.02; done"
    got = b""
    with secured.client() as client:
        with client.stream("POST", "/process.Process/Start", content=_start(cmd), headers=headers) as r:
            assert r.status_code == 200
            for chunk in r.iter_raw():
                got += chunk
                if got.count(b"line-") >= 3 or b'"data"' in got and len(got) > 300:
                    break  # cut: the connection is closed with the stream half read, maybe inside a frame
        time.sleep(0.5)  # the command runs on, its output kept for the next reader
        for bad, status in ((str(len(got) + 10**6), 416), ("-1", 416), ("x", 400)):
            refused = client.post(f"/keepstate/streams/{sid}", params={"offset": bad},
                                  headers={"X-Access-Token": secured.token})
            assert refused.status_code == status and refused.json()["code"] == status
        with client.stream("POST", f"/keepstate/streams/{sid}", params={"offset": len(got)},
                           headers={"X-Access-Token": secured.token}) as r:
            assert r.status_code == 200 and r.headers["content-type"] == "application/connect+json"
            got += b"".join(r.iter_raw())
        gone = client.post(f"/keepstate/streams/{sid}", params={"offset": 0},
                           headers={"X-Access-Token": secured.token})
        assert gone.status_code == 404  # read to its end: forgotten
        stranger = client.post(f"/keepstate/streams/{sid}", params={"offset": 0})
        assert stranger.status_code == 401
    frames = _frames(got)
    events = [f[1]["event"] for f in frames if f[0] == 0]
    stdout = b"".join(base64.b64decode(e["data"]["stdout"]) for e in events if "data" in e)
    assert stdout.decode().split() == [f"line-{i}" for i in range(1, 41)]
    assert "start" in events[0] and events[-1]["end"]["exited"]
    assert frames[-1] == (2, {})


@host_only
def test_a_request_without_a_valid_stream_id_is_a_plain_stream(secured) -> None:
    headers = {"X-Access-Token": secured.token, "Content-Type": "application/connect+json",
               "X-KeepState-Stream": "not-an-id"}
    with secured.client() as client:
        r = client.post("/process.Process/Start", content=_start("echo plain"), headers=headers)
        assert r.status_code == 200
        assert _frames(r.content)[-1] == (2, {})


# -- the record's limits, in process ----------------------------------------------------------------------------
def _scope() -> dict:
    return {"type": "http", "method": "POST", "path": "/process.Process/Start", "headers": []}


class _Conn:
    """One connection's receive and send; `cut()` is the client going away."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self._gone = asyncio.Event()
        self._body_given = False

    async def receive(self) -> Message:
        if not self._body_given:
            self._body_given = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self._gone.is_set():
            raise OSError("disconnected")
        self.sent.append(message)

    def cut(self) -> None:
        self._gone.set()

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


def _ticker(count: int, every: float, ran: list[int]):  # type: ignore[no-untyped-def]
    async def handler(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(count):
            ran.append(i)
            await send({"type": "http.response.body", "body": b"%04d" % i, "more_body": True})
            await asyncio.sleep(every)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return handler


async def _served_then_cut(streams: Streams, sid: str, handler, ticks: list[int], after: int) -> _Conn:  # type: ignore[no-untyped-def]
    """Serve stream `sid`, cut its connection once the handler has ticked `after` times, and return that reader."""
    first = _Conn()
    serving = asyncio.create_task(streams.serve(sid, _scope(), first.receive, first.send, handler))
    while len(ticks) < after:
        await asyncio.sleep(0.005)
    first.cut()
    await serving
    return first


def test_the_handler_runs_on_without_a_reader_and_a_new_reader_gets_all_of_it() -> None:
    async def main() -> None:
        streams, ran = Streams(window=5), []
        first = await _served_then_cut(streams, "a" * 32, _ticker(20, 0.005, ran), ran, 3)
        while len(ran) < 20:  # on, with nobody reading
            await asyncio.sleep(0.005)
        second = _Conn()
        await streams.resume("a" * 32, len(first.body()), second.receive, second.send)
        assert first.body() + second.body() == b"".join(b"%04d" % i for i in range(20))
        assert second.sent[0]["status"] == 200 and second.sent[-1]["more_body"] is False
        assert len(streams) == 0

    asyncio.run(main())


def test_a_stream_nobody_resumes_expires_and_its_handler_is_cancelled() -> None:
    async def main() -> None:
        streams, ran = Streams(window=0.1), []
        await _served_then_cut(streams, "b" * 32, _ticker(10_000, 0.005, ran), ran, 1)
        await asyncio.sleep(0.3)
        assert len(streams) == 0
        stopped_at = len(ran)
        await asyncio.sleep(0.05)
        assert len(ran) == stopped_at < 10_000  # cancelled, not running on to nobody
        with pytest.raises(HTTPError) as e:
            await streams.resume("b" * 32, 0, _Conn().receive, _Conn().send)
        assert e.value.status == 404

    asyncio.run(main())


def test_a_stream_without_a_reader_is_dropped_past_its_size_limit() -> None:
    async def main() -> None:
        streams, ran = Streams(window=60, keep=8, limit=64), []
        await _served_then_cut(streams, "c" * 32, _ticker(10_000, 0.001, ran), ran, 1)
        for _ in range(200):
            if not len(streams):
                break
            await asyncio.sleep(0.005)
        assert len(streams) == 0 and len(ran) < 10_000

    asyncio.run(main())


def test_a_handler_that_fails_mid_stream_is_an_interrupted_stream_not_an_ended_one() -> None:
    async def failing(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"partial", "more_body": True})
        raise ValueError("boom")

    async def main() -> None:
        streams, conn = Streams(), _Conn()
        with pytest.raises(RuntimeError):
            await streams.serve("d" * 32, _scope(), conn.receive, conn.send, failing)
        assert conn.body() == b"partial" and not any(m.get("more_body") is False for m in conn.sent)

    asyncio.run(main())
