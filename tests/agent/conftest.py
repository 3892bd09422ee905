from __future__ import annotations

import os
import pwd
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.harness import AgentProcess, ControlPlaneStub

USER = "user"


@pytest.fixture(scope="session")
def sandbox_user() -> str:
    if os.geteuid() != 0:
        pytest.skip("the agent tests switch users and chown files: they must run as root")
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", USER], check=False, capture_output=True)
        pwd.getpwnam(USER)  # another xdist worker may have won the race; either way it exists now
    return USER


@pytest.fixture(scope="session")
def agent(sandbox_user: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    proc = AgentProcess(tmp_path_factory.mktemp("agent")).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def control_plane(agent: AgentProcess) -> Iterator[ControlPlaneStub]:
    stub = ControlPlaneStub(agent)
    saved = {k: os.environ.get(k) for k in ("E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DEBUG")}
    os.environ.update({"E2B_API_KEY": "e2b_test", "E2B_API_URL": stub.url, "E2B_SANDBOX_URL": agent.url})
    os.environ.pop("E2B_DEBUG", None)
    yield stub
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    stub.stop()


@pytest.fixture
def sandbox(control_plane: ControlPlaneStub):  # type: ignore[no-untyped-def]
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=60)
    yield sbx
    sbx.kill()


@pytest.fixture
async def async_sandbox(control_plane: ControlPlaneStub):  # type: ignore[no-untyped-def]
    from e2b import AsyncSandbox

    sbx = await AsyncSandbox.create(timeout=60)
    yield sbx
    await sbx.kill()


@pytest.fixture
def home_dir(sandbox_user: str) -> Iterator[str]:
    """A fresh directory under the user's home (relative name, absolute path), removed afterwards."""
    name = "t-" + uuid.uuid4().hex[:10]
    path = Path(pwd.getpwnam(sandbox_user).pw_dir) / name
    yield str(path)
    subprocess.run(["rm", "-rf", str(path)], check=False)
