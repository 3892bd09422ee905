"""Interrupts, keepalives, reconnecting, a sandbox killed mid-execution, and the async SDK."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
from e2b import TimeoutException
from e2b_code_interpreter import AsyncSandbox, Sandbox

from keepstate.ports import INTERPRETER_PORT


def test_client_timeout_interrupts_kernel(sandbox: Sandbox) -> None:
    sandbox.run_code("import time; done = False")
    with pytest.raises(TimeoutException):
        sandbox.run_code("time.sleep(60); done = True", timeout=2)
    # The bridge interrupted the sleep: the next execution runs now, not in a minute.
    execution = sandbox.run_code("done", timeout=20)
    assert execution.text == "False"


@pytest.mark.parametrize(("language", "setup", "sleep", "check"), [
    ("r", "done <- FALSE", "Sys.sleep(60); done <- TRUE", "done"),
    ("java", "boolean done = false;", "Thread.sleep(60000); done = true;", "done"),
])
def test_client_timeout_interrupts_r_and_java(sandbox: Sandbox, language: str, setup: str, sleep: str,
                                              check: str) -> None:
    sandbox.run_code(setup, language=language, timeout=240)
    with pytest.raises(TimeoutException):
        sandbox.run_code(sleep, language=language, timeout=2)
    execution = sandbox.run_code(check, language=language, timeout=20)
    assert execution.text in ("[1] FALSE", "false"), execution


def test_keepalive_lines_are_ignored_by_sdk(sandbox: Sandbox) -> None:
    # 6 s of silence makes the bridge send a keepalive line; the SDK must not choke on it.
    execution = sandbox.run_code("import time; time.sleep(6); 'awake'")
    assert execution.text == "awake"


def test_reconnect_sees_earlier_state(sandbox: Sandbox) -> None:
    sandbox.run_code("reconnect_marker = 'kept'")
    again = Sandbox.connect(sandbox.sandbox_id)
    assert again.run_code("reconnect_marker").text == "kept"
    ctx = again.create_code_context(language="bash")
    try:
        # Contexts made through one handle are visible through the other.
        assert ctx.id in [c.id for c in sandbox.list_code_contexts()]
    finally:
        sandbox.remove_code_context(ctx)


async def test_async_reconnect(async_sandbox: AsyncSandbox) -> None:
    await async_sandbox.run_code("async_marker = 7")
    again = await AsyncSandbox.connect(async_sandbox.sandbox_id)
    assert (await again.run_code("async_marker * 6")).text == "42"


def test_sandbox_killed_during_execution(new_sandbox: Callable[..., Sandbox]) -> None:
    sandbox = new_sandbox()
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


async def test_async_errors_and_interrupt(async_sandbox: AsyncSandbox) -> None:
    errors = []
    execution = await async_sandbox.run_code("1 / 0", on_error=errors.append)
    assert execution.error is not None and execution.error.name == "ZeroDivisionError"
    assert errors == [execution.error]
    await async_sandbox.run_code("import time; finished = False")
    with pytest.raises(TimeoutException):
        await async_sandbox.run_code("time.sleep(60); finished = True", timeout=2)
    assert (await async_sandbox.run_code("finished", timeout=20)).text == "False"


async def test_async_concurrent_contexts(async_sandbox: AsyncSandbox) -> None:
    # Two kernels run at the same time: each sleeps 1 s, and each sees only its own variable.
    a, b = await asyncio.gather(async_sandbox.create_code_context(), async_sandbox.create_code_context())
    try:
        await asyncio.gather(async_sandbox.run_code("who = 'a'", context=a),
                             async_sandbox.run_code("who = 'b'", context=b))
        ra, rb = await asyncio.gather(async_sandbox.run_code("import time; time.sleep(1); who", context=a),
                                      async_sandbox.run_code("import time; time.sleep(1); who", context=b))
        assert (ra.text, rb.text) == ("a", "b")
    finally:
        await asyncio.gather(async_sandbox.remove_code_context(a), async_sandbox.remove_code_context(b))


def test_bridge_log_is_in_the_sandbox(sandbox: Sandbox) -> None:
    from tests.interpreter.conftest import BRIDGE_LOG

    # The template service's output: what a failed test's report shows (conftest.pytest_runtest_makereport).
    assert f"code interpreter listening on 0.0.0.0:{INTERPRETER_PORT}" in sandbox.files.read(BRIDGE_LOG, user="root")
