"""Jupyter messages → the NDJSON lines of `POST /execute` (protocol notes §4). Pure: no I/O.

One `ExecutionOutput` follows one `execute_request`: feed it every iopub and shell message whose
parent is that request; it returns the lines to stream and tells when the execution is over
(the kernel went idle *and* the execute_reply arrived, in either order).
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass, field
from typing import Any

Line = dict[str, Any]

# Jupyter MIME type → key of the SDK's `Result`; anything else goes to `extra`.
MIME_KEYS: dict[str, str] = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}

KEEPALIVE: Line = {"type": "keepalive"}
END: Line = {"type": "end_of_execution"}
UNEXPECTED_END: Line = {"type": "unexpected_end_of_execution"}


# The metadata key of a display_data that is a cell's result (the code-interpreter template's tslab patch).
EXECUTE_RESULT_MARK = "keepstate/execute_result"

def encode(line: Line) -> bytes:
    """One NDJSON record: json.dumps never emits a raw newline, and there are no blank lines."""
    return json.dumps(line, ensure_ascii=False).encode() + b"\n"


def timestamp(value: object) -> str:
    """ISO-8601 time of a message (jupyter_client parses header dates into datetimes)."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return value.isoformat()
    if isinstance(value, str) and value:
        return value
    return dt.datetime.now(dt.UTC).isoformat()


def _strip_quotes(text: str) -> str:
    # A Python str result reprs as 'abc'; the SDK's users expect abc (as E2B's server gives).
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def result_line(bundle: dict[str, Any], is_main_result: bool) -> Line:
    line: Line = {"type": "result", "is_main_result": is_main_result}
    extra: dict[str, Any] = {}
    for mime, value in bundle.items():
        key = MIME_KEYS.get(mime)
        if key is None:
            extra[mime] = value
        elif key == "text":
            line["text"] = _strip_quotes(value) if isinstance(value, str) else value
        else:
            line[key] = value
    line["extra"] = extra
    return line


def error_line(name: str, value: str, traceback: list[str] | str) -> Line:
    # Jupyter tracebacks are lists of (multi-line) strings without trailing newlines.
    text = traceback if isinstance(traceback, str) else "\n".join(traceback)
    return {"type": "error", "name": name, "value": value, "traceback": text}


@dataclass
class ExecutionOutput:
    """Translates the messages of one execute_request. `silent` executions emit nothing.

    `displayed_values`: the kernel sends a top-level expression's visible value as a display_data without the
    `source` its display() calls carry (IRkernel). Such a value is the main result if it is the cell's last output:
    each is held back until the next line or the end, and sent as a plain display if anything follows it.
    """

    silent: bool = False
    displayed_values: bool = False
    idle: bool = False
    reply: dict[str, Any] | None = None
    _started: bool = False  # the kernel began running the code (execute_input, or output of it)
    _held: Line | None = None
    _error_sent: bool = False
    _count_sent: bool = False
    _stderr_tail: list[str] = field(default_factory=list)
    _failed_reply: dict[str, Any] | None = None  # an error reply that names no error, waiting for the stderr

    @property
    def done(self) -> bool:
        return self.idle and self.reply is not None

    @property
    def aborted(self) -> bool:
        """The kernel refused the request without running it (tslab does so for 200 ms after an error).

        Not an execution that began and was interrupted, which IRkernel also answers with `abort`.
        """
        return self.reply is not None and self.reply.get("status") in ("abort", "aborted") and not self._started

    @property
    def failed(self) -> bool:
        return self._error_sent or (self.reply is not None and self.reply.get("status") == "error")

    def feed(self, msg: dict[str, Any]) -> list[Line]:
        kind = msg.get("msg_type") or msg.get("header", {}).get("msg_type")
        content: dict[str, Any] = msg.get("content") or {}
        if kind in ("execute_input", "stream", "execute_result", "display_data", "error"):
            self._started = True
        if (self.displayed_values and not self.silent and kind == "display_data"
                and "source" not in content):
            lines = [] if self._held is None else [{**self._held, "is_main_result": False}]
            self._held = result_line(content.get("data") or {}, True)
            return lines
        lines = self._feed(kind, msg)
        if self._held is not None and (lines or self.done):
            # The result only if nothing came after it (as of Python's last expression, not `1; print(2)`).
            lines.insert(0, self._held if not lines else {**self._held, "is_main_result": False})
            self._held = None
        return lines

    def pending(self) -> list[Line]:
        """Lines held back, for an execution finished before the kernel said it was done."""
        held, self._held = self._held, None
        return [] if held is None else [held]

    def _feed(self, kind: str | None, msg: dict[str, Any]) -> list[Line]:
        content: dict[str, Any] = msg.get("content") or {}
        when = timestamp(msg.get("header", {}).get("date"))
        if kind == "status":
            if content.get("execution_state") == "idle":
                self.idle = True
                if self._failed_reply is not None and not self._error_sent:
                    return self._error_from_reply(self._failed_reply)
            return []
        if kind == "execute_reply":
            self.reply = content
            return [] if self.silent else self._on_reply(content)
        if self.silent:
            if kind == "error":
                self._error_sent = True
            return []
        if kind == "execute_input":
            return self._count(content.get("execution_count"))
        if kind == "stream":
            name = "stderr" if content.get("name") == "stderr" else "stdout"
            text = str(content.get("text", ""))
            if name == "stderr":
                self._stderr_tail = (self._stderr_tail + [text])[-20:]
            return [{"type": name, "text": text, "timestamp": when}] if text else []
        if kind == "execute_result":
            return [result_line(content.get("data") or {}, True)]
        if kind == "display_data":
            # tslab's last expression (the template patches it to send one so marked) is the main result.
            main = bool((content.get("metadata") or {}).get(EXECUTE_RESULT_MARK))
            return [result_line(content.get("data") or {}, main)]
        if kind == "error":
            self._error_sent = True
            # bash_kernel reports a failing command with an empty name and the exit status as value.
            return [error_line(str(content.get("ename") or "Error"), str(content.get("evalue", "")),
                               content.get("traceback") or [])]
        return []

    def _count(self, count: object) -> list[Line]:
        if self._count_sent or not isinstance(count, int):
            return []
        self._count_sent = True
        return [{"type": "number_of_executions", "execution_count": count}]

    def _on_reply(self, content: dict[str, Any]) -> list[Line]:
        if content.get("status") in ("abort", "aborted"):
            return []
        # Kernels that publish no execute_input (tslab) still give the count in the reply.
        lines = self._count(content.get("execution_count"))
        if content.get("status") == "error" and not self._error_sent:
            if content.get("ename") or content.get("evalue") or self.idle:
                lines.extend(self._error_from_reply(content))
            else:
                # A kernel that reports failure only in the reply and prints the error (tslab: to stderr, on
                # IOPub). The reply (shell channel) may overtake that output; all of it precedes the idle status.
                self._failed_reply = content
        return lines

    def _error_from_reply(self, content: dict[str, Any]) -> list[Line]:
        self._error_sent = True
        stderr = "".join(self._stderr_tail).strip()
        name, value = str(content.get("ename") or ""), str(content.get("evalue") or "")
        if not name and not value:
            name, value = _error_from_text(stderr)
        return [error_line(name or "Error", value, content.get("traceback") or stderr)]


_ERROR_LINE = re.compile(r"^([A-Za-z_$][\w$.]*(?:Error|Exception)|Error): ?(.*)$")


def _error_from_text(text: str) -> tuple[str, str]:
    """Name and message of an error a kernel only printed (Node's `Error: boom` stack layout)."""
    for line in text.splitlines():
        m = _ERROR_LINE.match(line.strip())
        if m:
            return m.group(1), m.group(2)
    return "Error", text.splitlines()[-1] if text else "execution failed"
