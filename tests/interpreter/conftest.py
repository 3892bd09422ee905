"""Fixtures: real `code-interpreter-v1` gVisor sandboxes through the stock e2b-code-interpreter SDK.

The server is the run's shared one (KEEPSTATE_TEST_API/KEEPSTATE_TEST_KEY, set by scripts/test.sh)
or one these fixtures start and share between xdist workers (tests/interpreter/server.py).

`sandbox` and `async_sandbox` are shared by the tests of a module: tests must not kill them and
must not depend on state other tests leave (fresh kernels come from `create_code_context`).
`new_sandbox` makes sandboxes a test owns.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import pytest
from e2b_code_interpreter import AsyncSandbox, Sandbox

from keepstate.ports import INTERPRETER_PORT
from tests.interpreter import server

SANDBOX_TIMEOUT = 600  # seconds: the server kills the sandbox after this even if a test leaks it
HOME = "/home/user"
BRIDGE_START_TIMEOUT = 120.0


def wait_bridge(sbx: Sandbox | AsyncSandbox) -> None:
    """Until the sandbox's bridge answers on port 49999.

    A create returns once the sandbox's agent answers; a sandbox started for the create (the warm
    pool was empty) may not have its bridge listening yet, and the router then answers 502 "port is
    not open". Remove this when the server waits for template services before handing a sandbox out.
    """
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(INTERPRETER_PORT)}
    deadline = time.monotonic() + BRIDGE_START_TIMEOUT
    while True:
        try:
            if httpx.get(f"{sbx._jupyter_url}/health", headers=headers, timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the bridge of sandbox {sbx.sandbox_id} did not start")
        time.sleep(0.1)


@pytest.fixture(scope="session")
def keepstate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[server.Server]:
    base = tmp_path_factory.getbasetemp()
    # Under xdist every worker has its own basetemp inside one shared directory.
    shared_dir = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "interpreter-server"
    with server.shared(shared_dir) as srv:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("E2B_API_URL", srv.url)
            mp.setenv("E2B_SANDBOX_URL", srv.url)
            mp.setenv("E2B_API_KEY", srv.key)
            mp.setenv("NO_PROXY", "127.0.0.1,localhost")
            mp.delenv("E2B_DEBUG", raising=False)
            yield srv


@pytest.fixture(scope="module")
def sandbox(keepstate: server.Server) -> Iterator[Sandbox]:
    sbx = Sandbox.create(timeout=SANDBOX_TIMEOUT)
    try:
        wait_bridge(sbx)
        yield sbx
    finally:
        sbx.kill()


@pytest.fixture(scope="module")
async def async_sandbox(keepstate: server.Server) -> AsyncIterator[AsyncSandbox]:
    sbx = await AsyncSandbox.create(timeout=SANDBOX_TIMEOUT)
    try:
        await asyncio.to_thread(wait_bridge, sbx)
        yield sbx
    finally:
        await sbx.kill()


@pytest.fixture
def new_sandbox(keepstate: server.Server) -> Iterator[Callable[..., Sandbox]]:
    made: list[Sandbox] = []

    def make(**kw: object) -> Sandbox:
        kw.setdefault("timeout", SANDBOX_TIMEOUT)
        sbx = Sandbox.create(**kw)  # type: ignore[arg-type]
        made.append(sbx)
        wait_bridge(sbx)
        return sbx

    make.made = made  # type: ignore[attr-defined] # for the bridge logs of a failed test
    yield make
    for sbx in made:
        sbx.kill()


BRIDGE_LOG = "/var/log/keepstate/code-interpreter.log"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report carries the tail of the bridge log of every sandbox it used, read while the
    sandboxes still live (their teardown comes after this report)."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    args = getattr(item, "funcargs", {})
    # The test's own handles, not Sandbox.connect: a connect would resume a sandbox that was paused or timed out,
    # and show the log of the checkpoint, not of what went wrong.
    used = [args["sandbox"]] if "sandbox" in args else []
    used += getattr(args.get("new_sandbox"), "made", [])
    if "async_sandbox" in args:  # its handle lives on the test loop: reach it by ID, only if it still runs
        try:
            sid = args["async_sandbox"].sandbox_id
            if Sandbox.get_info(sid, request_timeout=10).state.value == "running":
                used.append(Sandbox.connect(sid, request_timeout=10))
        except Exception as exc:  # noqa: BLE001 - a diagnostic: say why there is none
            report.sections.append(("bridge log of the async sandbox", f"(cannot reach it: {exc})"))
    for sbx in used:
        try:
            text = sbx.files.read(BRIDGE_LOG, user="root", request_timeout=10)
        except Exception as exc:  # noqa: BLE001 - a diagnostic: say why there is none
            text = f"(cannot read it: {type(exc).__name__}: {exc})"
        report.sections.append((f"bridge log of sandbox {sbx.sandbox_id}", text[-6000:]))
