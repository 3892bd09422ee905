"""Fixtures: a code-interpreter sandbox for the stock e2b-code-interpreter SDK.

Test bodies see only the SDK objects (`sandbox`, `async_sandbox`) and `sandbox_home`, so the stub
below can be swapped for a real KeepState server: set KEEPSTATE_TEST_E2B=1 with E2B_API_URL,
E2B_SANDBOX_URL and E2B_API_KEY pointing at it (sandbox_home is then /home/user).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
from e2b_code_interpreter import AsyncSandbox, Sandbox

from tests.interpreter import kernel_env
from tests.interpreter.stub import Stub

REAL_SERVER = os.environ.get("KEEPSTATE_TEST_E2B") == "1"


@pytest.fixture(scope="session")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stub | None]:
    if REAL_SERVER:
        yield None
        return
    venv = kernel_env.ensure()
    s = Stub(venv, tmp_path_factory.mktemp("sandboxes"))
    s.start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("E2B_API_KEY", "e2b_test_key")
        mp.setenv("E2B_API_URL", s.url)
        mp.setenv("E2B_SANDBOX_URL", s.url)
        mp.delenv("E2B_DEBUG", raising=False)
        yield s
    s.stop()


@pytest.fixture
def sandbox(stub: Stub | None) -> Iterator[Sandbox]:
    sbx = Sandbox.create()
    try:
        yield sbx
    finally:
        sbx.kill()


@pytest.fixture
async def async_sandbox(stub: Stub | None) -> AsyncIterator[AsyncSandbox]:
    sbx = await AsyncSandbox.create()
    try:
        yield sbx
    finally:
        await sbx.kill()


@pytest.fixture
def sandbox_home(stub: Stub | None, sandbox: Sandbox) -> str:
    """The default working directory of `sandbox`'s contexts."""
    return "/home/user" if stub is None else stub.home(sandbox.sandbox_id)


def js_available(stub: Stub | None) -> bool:
    return stub is None or (stub.venv / "share" / "jupyter" / "kernels" / "jslab").exists()
