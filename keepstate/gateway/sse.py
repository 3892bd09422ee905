"""Server-sent events: split a byte stream into whole events without buffering past one event."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SseEvent:
    raw: bytes  # the event as received, terminator included, so relaying it is byte-exact
    event: str | None
    data: bytes


class SseSplitter:
    """Feed chunks as they arrive; get back the events they complete."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[SseEvent]:
        self._buf += chunk
        out: list[SseEvent] = []
        while True:
            end, term = _find_terminator(self._buf)
            if end < 0:
                return out
            raw, self._buf = self._buf[: end + term], self._buf[end + term :]
            out.append(parse_event(raw))

    def rest(self) -> bytes:
        """Bytes of an unfinished event (a stream cut mid-event)."""
        return self._buf


def _find_terminator(buf: bytes) -> tuple[int, int]:
    best = (-1, 0)
    for term in (b"\n\n", b"\r\n\r\n", b"\r\r"):
        i = buf.find(term)
        if i >= 0 and (best[0] < 0 or i < best[0]):
            best = (i, len(term))
    return best


def parse_event(raw: bytes) -> SseEvent:
    event: str | None = None
    data: list[bytes] = []
    for line in raw.splitlines():
        if line.startswith(b"data:"):
            data.append(line[5:].removeprefix(b" "))
        elif line.startswith(b"event:"):
            event = line[6:].strip().decode("utf-8", "replace")
    return SseEvent(raw=raw, event=event, data=b"\n".join(data))


def split_all(body: bytes) -> list[SseEvent]:
    splitter = SseSplitter()
    events = splitter.feed(body)
    if splitter.rest().strip():
        events.append(parse_event(splitter.rest()))
    return events
