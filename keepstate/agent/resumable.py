"""Streams the host's router can pick up again after their connection was cut (docs/design/resumable-streams.md).

A snapshot closes every connection into the sandbox; a command's output stream must not end for it. A request that
carries `X-KeepState-Stream: <id>` has its handler run apart from its connection: what the handler sends goes into
the stream's record, and a connection is only a reader of that record, from a byte offset on. The first reader is
the request's own connection; `POST /keepstate/streams/<id>?offset=N` attaches another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable

from keepstate.agent.asgi import HTTPError, Message, Receive, Scope, Send, header

log = logging.getLogger("keepstate.agent")
STREAM_HEADER = "x-keepstate-stream"
WINDOW = 60.0  # seconds a stream without a reader is kept
KEEP_BEHIND = 4 << 20  # bytes kept after they were sent: what can be in flight when a connection is cut
LIMIT = 16 << 20  # bytes a stream without a reader may hold before it is dropped
_ID = re.compile(r"[0-9a-f]{32}")
Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


def stream_id(scope: Scope) -> str | None:
    """The id of a request whose answer is to be resumable, if it is one (a POST the host's router marked)."""
    if scope.get("method") != "POST":
        return None
    sid = header(scope, STREAM_HEADER)
    return sid if sid is not None and _ID.fullmatch(sid) else None


class _Stream:
    def __init__(self, sid: str) -> None:
        self.id = sid
        self.start: Message | None = None
        self.data = bytearray()
        self.base = 0  # the offset of data[0] in the stream's body
        self.done = False
        self.failed = False
        self.dropped = False
        self.reader: object | None = None  # the attached reader's token
        self.task: asyncio.Task[None] | None = None
        self.over = asyncio.Event()  # ended or dropped: the handler's receive answers a disconnect
        self.expiry: asyncio.TimerHandle | None = None
        self._changed = asyncio.Event()

    @property
    def end(self) -> int:
        return self.base + len(self.data)

    def changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self) -> None:
        await self._changed.wait()


class Streams:
    def __init__(self, window: float = WINDOW, keep: int = KEEP_BEHIND, limit: int = LIMIT) -> None:
        self.window, self.keep, self.limit = window, keep, limit
        self._streams: dict[str, _Stream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    async def serve(self, sid: str, scope: Scope, receive: Receive, send: Send, handler: Handler) -> None:
        """The request that opens stream `sid`: run its handler apart, and be the stream's first reader."""
        if sid in self._streams:
            raise HTTPError(409, f"stream {sid} exists already")
        stream = self._streams[sid] = _Stream(sid)
        body_in = asyncio.Event()

        async def handler_receive() -> Message:
            if body_in.is_set():
                await stream.over.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_in.set()
            return message

        async def handler_send(message: Message) -> None:
            if stream.over.is_set():
                return
            if message["type"] == "http.response.start":
                stream.start = message
            elif message["type"] == "http.response.body":
                stream.data += message.get("body", b"")
                stream.done = not message.get("more_body", False)
            stream.changed()
            if stream.reader is None and not stream.done and len(stream.data) > self.limit:
                log.warning("stream %s: %d bytes unread without a reader, dropped", sid, len(stream.data))
                self._drop(stream)

        stream.task = asyncio.get_running_loop().create_task(self._run(stream, handler, scope, handler_receive,
                                                                       handler_send))
        await self._read(stream, 0, receive, send, body_in)

    async def resume(self, sid: str, offset: int, receive: Receive, send: Send) -> None:
        """A new reader of stream `sid` from body byte `offset` on."""
        stream = self._streams.get(sid)
        if stream is None:
            raise HTTPError(404, f"no stream {sid}: it ended, expired or was dropped")
        if not stream.base <= offset <= stream.end:
            raise HTTPError(416, f"offset {offset} is outside what stream {sid} holds ({stream.base}-{stream.end})")
        await self._read(stream, offset, receive, send, None)

    async def _run(self, stream: _Stream, handler: Handler, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await handler(scope, receive, send)
        except asyncio.CancelledError:
            return  # dropped
        except Exception:
            log.exception("the handler of stream %s failed", stream.id)
            stream.failed = True
        if not stream.done:
            stream.failed = stream.done = True
        stream.changed()

    async def _read(self, stream: _Stream, offset: int, receive: Receive, send: Send,
                    body_in: asyncio.Event | None) -> None:
        token = object()
        stream.reader = token  # a reader attached before is replaced: it ends at its next look
        stream.changed()
        if stream.expiry is not None:
            stream.expiry.cancel()
            stream.expiry = None
        watcher = asyncio.get_running_loop().create_task(self._watch(stream, token, receive, body_in))
        pos, started = offset, False
        try:
            while stream.reader is token:
                if stream.dropped or (stream.failed and stream.start is None):
                    raise RuntimeError(f"stream {stream.id} was dropped or its handler failed before answering")
                if not started:
                    if stream.start is not None:
                        await send(dict(stream.start))
                        started = True
                        continue
                elif pos < stream.end:
                    chunk = bytes(stream.data[pos - stream.base :])
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    pos += len(chunk)
                    self._trim(stream, pos)
                    continue
                elif stream.done:
                    self._forget(stream)
                    if stream.failed:  # the client must see an interrupted stream, not an ended one
                        raise RuntimeError(f"the handler of stream {stream.id} failed")
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                await stream.wait()
        except OSError:
            pass  # the connection went away (uvicorn's ClientDisconnected is an OSError)
        finally:
            watcher.cancel()
            if stream.reader is token:
                self._detach(stream)

    async def _watch(self, stream: _Stream, token: object, receive: Receive, body_in: asyncio.Event | None) -> None:
        """A reader's connection going away detaches it (the handler has read the request's body first)."""
        if body_in is not None:
            await body_in.wait()
        while (await receive())["type"] != "http.disconnect":
            pass
        if stream.reader is token:
            self._detach(stream)

    def _detach(self, stream: _Stream) -> None:
        stream.reader = None
        stream.changed()
        if stream.id in self._streams and stream.expiry is None:
            stream.expiry = asyncio.get_running_loop().call_later(self.window, self._expire, stream)

    def _expire(self, stream: _Stream) -> None:
        stream.expiry = None
        if stream.reader is None:
            self._drop(stream)

    def _trim(self, stream: _Stream, pos: int) -> None:
        behind = pos - stream.base
        if behind > 2 * self.keep:  # amortised: the front of a bytearray is moved, not freed in place
            cut = behind - self.keep
            del stream.data[:cut]
            stream.base += cut

    def _forget(self, stream: _Stream) -> None:
        self._streams.pop(stream.id, None)
        if stream.expiry is not None:
            stream.expiry.cancel()
            stream.expiry = None
        stream.over.set()

    def _drop(self, stream: _Stream) -> None:
        stream.dropped = True
        self._forget(stream)
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()
        stream.data = bytearray()
        stream.changed()

    def close(self) -> None:
        for stream in list(self._streams.values()):
            with contextlib.suppress(RuntimeError):
                self._drop(stream)
