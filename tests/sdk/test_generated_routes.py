"""The SDK's own generated clients for the calls it has no wrapper for (a user may call them directly): refresh,
the older resume, logs v1 and v2, metrics of many sandboxes; and `Template.exists`. Each release's models parse
our answers."""

from __future__ import annotations

import importlib
import typing
from typing import Any

from e2b import Sandbox, Template
from e2b.connection_config import ConnectionConfig
from e2b.sandbox_sync.paginator import get_api_client

from sdkharness import wait_until


def call(module: str, *args: Any, body: dict[str, Any] | None = None, **query: Any) -> Any:
    """`sync_detailed` of one generated module; `body` is built with the model that release annotates."""
    mod = importlib.import_module(f"e2b.api.client.api.{module}")
    kwargs: dict[str, Any] = {"client": get_api_client(ConnectionConfig()), **query}
    if body is not None:
        kwargs["body"] = typing.get_type_hints(mod.sync_detailed)["body"].from_dict(body)
    return mod.sync_detailed(*args, **kwargs)


def test_template_exists() -> None:
    assert Template.exists("base")
    assert not Template.exists("no-such-template-here")


def test_refresh_resume_logs_and_metrics(new_sandbox) -> None:
    sbx: Sandbox = new_sandbox(timeout=60)
    sid = sbx.sandbox_id
    sbx.commands.run("echo hello from the logs")
    before = sbx.get_info().end_at
    assert call("sandboxes.post_sandboxes_sandbox_id_refreshes", sid, body={"duration": 600}).status_code == 204
    assert sbx.get_info().end_at > before

    assert call("sandboxes.post_sandboxes_sandbox_id_resume", sid, body={"timeout": 60}).status_code == 409
    sbx.pause()
    res = call("sandboxes.post_sandboxes_sandbox_id_resume", sid, body={"timeout": 120})
    assert res.status_code == 201 and res.parsed.sandbox_id == sid
    assert sbx.commands.run("true").exit_code == 0

    def v2_messages() -> list[str]:
        v2 = call("sandboxes.get_v_2_sandboxes_sandbox_id_logs", sid)
        assert v2.status_code == 200, v2.content
        return [e.message for e in v2.parsed.logs]

    # Log lines arrive with the sandbox's journal, pulled after the command answered: wait for the last one's exit,
    # so that the v1 read below sees no line the v2 read did not.
    messages = wait_until(lambda: (m := v2_messages()) and any("-c true" in x for x in m)
                          and m[-1].endswith("exited with code 0") and m, 30, "the logs of `true`")
    assert any(m.startswith("process ") and "echo hello from the logs" in m for m in messages), messages
    assert any(m.startswith("paused (checkpoint") for m in messages), messages
    v1 = call("sandboxes.get_sandboxes_sandbox_id_logs", sid)
    assert v1.status_code == 200 and [line.line for line in v1.parsed.logs] == messages

    res = call("sandboxes.get_sandboxes_metrics", sandbox_ids=[sid, "nosuchsandbox0000000"])
    assert res.status_code == 200, res.content
    assert set(res.parsed.sandboxes) <= {sid}  # a sample may not have been taken yet since the resume
