"""Jupyter messages → NDJSON lines (keepstate.agent.interpreter.output), without kernels."""

from __future__ import annotations

import datetime as dt
import json

from keepstate.agent.interpreter.output import (
    END,
    EXECUTE_RESULT_MARK,
    ExecutionOutput,
    encode,
    error_line,
    result_line,
)

WHEN = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)


def msg(kind: str, **content: object) -> dict:
    return {"msg_type": kind, "header": {"msg_type": kind, "date": WHEN}, "content": content}


def test_result_line_maps_mime_types() -> None:
    line = result_line({"text/plain": "'hi'", "image/png": "AAA", "e2b/data": {"a": [1]},
                        "application/x-thing": 1}, True)
    assert line == {"type": "result", "is_main_result": True, "text": "hi", "png": "AAA",
                    "data": {"a": [1]}, "extra": {"application/x-thing": 1}}


def test_full_execution() -> None:
    out = ExecutionOutput()
    lines = []
    for m in [msg("status", execution_state="busy"), msg("execute_input", execution_count=3),
              msg("stream", name="stdout", text="a\n"), msg("display_data", data={"text/html": "<b/>"}),
              msg("execute_result", data={"text/plain": "2"}, execution_count=3)]:
        lines += out.feed(m)
    assert not out.done
    lines += out.feed(msg("execute_reply", status="ok", execution_count=3))
    assert not out.done  # idle not seen yet
    lines += out.feed(msg("status", execution_state="idle"))
    assert out.done
    assert [line["type"] for line in lines] == ["number_of_executions", "stdout", "result", "result"]
    assert lines[1]["timestamp"] == "2026-01-02T03:04:05+00:00"
    assert lines[2]["is_main_result"] is False and lines[3]["is_main_result"] is True


def test_a_display_marked_as_the_cells_result_is_the_main_result() -> None:
    """tslab's last expression, as the template's patch sends it."""
    out = ExecutionOutput()
    lines = out.feed(msg("display_data", data={"text/plain": "21"}, metadata={EXECUTE_RESULT_MARK: True}))
    lines += out.feed(msg("display_data", data={"text/plain": "shown"}, metadata={}))
    assert [(line["text"], line["is_main_result"]) for line in lines] == [("21", True), ("shown", False)]


def test_displayed_values_the_last_is_the_main_result() -> None:
    """IRkernel: a visible value is a display_data without `source`; a display() call's has one."""
    out = ExecutionOutput(displayed_values=True)
    lines = out.feed(msg("execute_input", execution_count=1))
    lines += out.feed(msg("display_data", data={"text/plain": "[1] 1"}, metadata={}))
    assert len(lines) == 1  # the value is held: another may follow
    lines += out.feed(msg("display_data", data={"text/plain": "shown"}, metadata={}, source="R display func"))
    lines += out.feed(msg("display_data", data={"text/plain": "[1] 2"}, metadata={}))
    lines += out.feed(msg("display_data", data={"text/plain": "[1] 3"}, metadata={}))
    lines += out.feed(msg("status", execution_state="idle"))
    assert lines[-1]["type"] == "result" and lines[-1]["text"] == "[1] 2"  # the last value still held
    lines += out.feed(msg("execute_reply", status="ok", execution_count=1))
    assert out.done
    # The main result is the last output, if a value: a value followed by anything (`1; print(2)`) is not.
    assert [(x["text"], x["is_main_result"]) for x in lines if x["type"] == "result"] == [
        ("[1] 1", False), ("shown", False), ("[1] 2", False), ("[1] 3", True)]
    plain = ExecutionOutput()  # other kernels: a display is never the result
    assert plain.feed(msg("display_data", data={"text/plain": "x"}, metadata={}))[0]["is_main_result"] is False


def test_an_interrupted_execution_is_not_an_unrun_one() -> None:
    """IRkernel answers an interrupted execution with `abort`, as tslab answers one it refused: only the
    refused one may be sent again."""
    refused = ExecutionOutput()
    refused.feed(msg("execute_reply", status="abort"))
    assert refused.aborted
    interrupted = ExecutionOutput()
    interrupted.feed(msg("execute_input", execution_count=2))
    interrupted.feed(msg("execute_reply", status="abort"))
    assert not interrupted.aborted


def test_error_reported_once() -> None:
    out = ExecutionOutput()
    lines = out.feed(msg("error", ename="ValueError", evalue="bad", traceback=["l1", "l2"]))
    lines += out.feed(msg("execute_reply", status="error", ename="ValueError", evalue="bad",
                          traceback=["l1", "l2"], execution_count=1))
    errors = [line for line in lines if line["type"] == "error"]
    assert errors == [error_line("ValueError", "bad", ["l1", "l2"])]
    assert errors[0]["traceback"] == "l1\nl2"


def test_error_only_in_reply_uses_stderr() -> None:
    out = ExecutionOutput()
    out.feed(msg("stream", name="stderr", text="at x\nTypeError: boom\n    at y\n"))
    lines = out.feed(msg("execute_reply", status="error", execution_count=4))
    assert lines == [{"type": "number_of_executions", "execution_count": 4}]
    lines = out.feed(msg("status", execution_state="idle"))  # all of the execution's output precedes idle
    assert [(x["name"], x["value"]) for x in lines] == [("TypeError", "boom")] and out.done


def test_error_reply_that_overtakes_the_printed_error_waits_for_it() -> None:
    """tslab reports a throw only in the reply and prints the error on IOPub; the reply, on the shell channel, may
    arrive first (seen in CI: the error came out as 'Error: execution failed')."""
    out = ExecutionOutput()
    lines = out.feed(msg("execute_reply", status="error", execution_count=5))
    lines += out.feed(msg("stream", name="stderr", text="TypeError: boom\n    at <anonymous>\n"))
    lines += out.feed(msg("status", execution_state="idle"))
    errors = [x for x in lines if x["type"] == "error"]
    assert [(x["name"], x["value"]) for x in errors] == [("TypeError", "boom")] and out.done and out.failed
    late = ExecutionOutput()  # idle first, then the reply: nothing more can come, so at once
    late.feed(msg("stream", name="stderr", text="RangeError: far\n"))
    late.feed(msg("status", execution_state="idle"))
    assert [(x["name"], x["value"]) for x in late.feed(msg("execute_reply", status="error"))
            if x["type"] == "error"] == [("RangeError", "far")]


def test_silent_and_aborted() -> None:
    silent = ExecutionOutput(silent=True)
    assert silent.feed(msg("stream", name="stdout", text="x")) == []
    assert silent.feed(msg("execute_reply", status="ok", execution_count=1)) == []
    aborted = ExecutionOutput()
    assert aborted.feed(msg("execute_reply", status="abort")) == []
    assert aborted.aborted


def test_encode_is_one_line() -> None:
    raw = encode({"type": "stdout", "text": "a\nb\n\n", "timestamp": "t"})
    assert raw.count(b"\n") == 1 and raw.endswith(b"\n")
    assert json.loads(raw)["text"] == "a\nb\n\n"
    assert encode(END) == b'{"type": "end_of_execution"}\n'
