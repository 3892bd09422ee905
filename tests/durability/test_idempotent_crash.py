"""`kill -9` of a server between recording a create and answering it (docs/design/idempotency.md): the stock SDK's
create with an idempotency key gets no answer; retried with the same key against the restarted server, it gets the
sandbox the first attempt made (adopted, running), and there is only that one."""

from __future__ import annotations

import os

import pytest
from e2b import Sandbox

from keepstate.faults import ENV

from .conftest import Fleet, sdk_opts


def test_a_create_recorded_but_never_answered_is_answered_after_the_restart(fleet: Fleet) -> None:
    os.environ[ENV] = "create-recorded"
    try:
        srv = fleet.start()
    finally:
        del os.environ[ENV]
    port = int(srv.url.rsplit(":", 1)[1])
    key = "crash-between-recording-and-answering"
    with pytest.raises(Exception):  # noqa: B017 - the server died mid-answer: the SDK's connection error, whatever it is
        Sandbox.create(timeout=300, idempotency_key=key, **sdk_opts(srv))
    assert srv.proc is not None and srv.proc.wait(timeout=30) == -9  # SIGKILLed itself at the fault point

    again = fleet.start(home=srv.home, port=port)
    again.key = srv.key
    sbx = Sandbox.create(timeout=300, idempotency_key=key, **sdk_opts(again))
    assert [s.sandbox_id for s in Sandbox.list(**sdk_opts(again)).next_items()] == [sbx.sandbox_id]
    assert sbx.commands.run("echo made once").stdout.strip() == "made once"
    assert Sandbox.create(timeout=300, idempotency_key=key, **sdk_opts(again)).sandbox_id == sbx.sandbox_id
    sbx.kill()
