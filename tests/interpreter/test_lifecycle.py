"""Interrupts, keepalives, a sandbox killed mid-execution, and the async SDK."""

from __future__ import annotations

import threading

import pytest
from e2b import TimeoutException
from e2b_code_interpreter import AsyncSandbox, Sandbox


def test_client_timeout_interrupts_kernel(sandbox: Sandbox) -> None:
    sandbox.run_code("import time; done = False")
    with pytest.raises(TimeoutException):
        sandbox.run_code("time.sleep(60); done = True", timeout=2)
    # The bridge interrupted the sleep: the next execution runs now, not in a minute.
    execution = sandbox.run_code("done", timeout=20)
    assert execution.text == "False"


def test_keepalive_lines_are_ignored_by_sdk(sandbox: Sandbox) -> None:
    # 6 s of silence makes the bridge send a keepalive line; the SDK must not choke on it.
    execution = sandbox.run_code("import time; time.sleep(6); 'awake'")
    assert execution.text == "awake"


def test_sandbox_killed_during_execution(sandbox: Sandbox) -> None:
    outcome: list[BaseException] = []

    started = threading.Event()

    def run() -> None:
        try:
            sandbox.run_code("import time; print('started', flush=True); time.sleep(60)", timeout=90,
                             on_stdout=lambda _: started.set())
        except BaseException as exc:  # noqa: BLE001 - the failure is the point of the test
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(60)
    sandbox.kill()
    thread.join(60)
    assert not thread.is_alive()
    assert outcome and "killed" in str(outcome[0])


async def test_async_sdk(async_sandbox: AsyncSandbox) -> None:
    out: list[str] = []
    await async_sandbox.run_code("z = 6")

    async def on_stdout(msg) -> None:
        out.append(msg.line)

    execution = await async_sandbox.run_code("print('async'); z * 7", on_stdout=on_stdout)
    assert execution.text == "42"
    assert out == ["async\n"]
    ctx = await async_sandbox.create_code_context()
    assert ctx.id in [c.id for c in await async_sandbox.list_code_contexts()]
    await async_sandbox.restart_code_context(ctx)
    await async_sandbox.remove_code_context(ctx)
    execution = await async_sandbox.run_code("import os; os.environ['K']", envs={"K": "v"})
    assert execution.text == "v"
