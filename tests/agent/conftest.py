"""Fixtures in two modes.

Host mode (default): the agent runs as a subprocess of this host, behind a tiny control-plane stub.
Real-sandbox mode (KEEPSTATE_TEST_API + KEEPSTATE_TEST_KEY set): every sandbox is a gVisor sandbox created with the
stock SDK through that KeepState server; tests marked host-only are skipped.
"""

from __future__ import annotations

import os
import pwd
import secrets
import subprocess
import uuid
from collections.abc import Iterator

import pytest

from tests.agent.harness import (
    HOST_ONLY_REASON,
    REMOTE,
    REMOTE_API,
    REMOTE_KEY,
    AgentProcess,
    ControlPlaneStub,
    Wire,
    wire_of,
)

USER = "user"


@pytest.fixture(scope="session")
def sandbox_user() -> str:
    if REMOTE:
        return USER  # the base template's default user
    return _host_user()


@pytest.fixture(scope="session")
def host_user() -> str:
    """The user of an agent these tests start on the host themselves, whether or not a server is under test."""
    return _host_user()


def _host_user() -> str:
    if os.geteuid() != 0:
        pytest.skip("the agent tests switch users and chown files: they must run as root")
    import fcntl

    # xdist workers (and other test runs on this host) may create the user at once: one at a time.
    with open("/tmp/keepstate-test-useradd.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entry = pwd.getpwnam(USER)
        except KeyError:
            subprocess.run(["useradd", "-m", "-s", "/bin/bash", USER], check=True, capture_output=True)
            entry = pwd.getpwnam(USER)
        # A home left by an earlier account of that name (deleted, then created again with another uid) is not
        # the user's own: the agent would refuse the user's writes into it.
        os.makedirs(entry.pw_dir, exist_ok=True)
        if os.stat(entry.pw_dir).st_uid != entry.pw_uid:
            os.chown(entry.pw_dir, entry.pw_uid, entry.pw_gid)
    return USER


@pytest.fixture(scope="session")
def agent(sandbox_user: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    if REMOTE:
        pytest.skip(HOST_ONLY_REASON)
    proc = AgentProcess(tmp_path_factory.mktemp("agent")).start()
    yield proc
    proc.stop()


def _swap_env(values: dict[str, str]) -> dict[str, str | None]:
    keys = ("E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DOMAIN", "E2B_DEBUG", "NO_PROXY")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.pop("E2B_DEBUG", None)
    os.environ.update(values)
    return saved


def _restore_env(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def control_plane(request: pytest.FixtureRequest) -> Iterator[ControlPlaneStub | None]:
    """Points the SDK at a control plane: the real server (None is yielded) or a stub over the host agent."""
    if REMOTE:
        domain = os.environ.get("KEEPSTATE_TEST_DOMAIN")  # the server reached by its domain only (test.sh)
        saved = _swap_env({"E2B_API_KEY": REMOTE_KEY, "NO_PROXY": "127.0.0.1,localhost",
                           **({"E2B_DOMAIN": domain} if domain else
                              {"E2B_API_URL": REMOTE_API, "E2B_SANDBOX_URL": REMOTE_API})})
        if domain:
            os.environ.pop("E2B_API_URL", None)
            os.environ.pop("E2B_SANDBOX_URL", None)
        yield None
        _restore_env(saved)
        return
    agent: AgentProcess = request.getfixturevalue("agent")
    stub = ControlPlaneStub(agent)
    saved = _swap_env({"E2B_API_KEY": "e2b_test", "E2B_API_URL": stub.url, "E2B_SANDBOX_URL": agent.url})
    yield stub
    _restore_env(saved)
    stub.stop()


@pytest.fixture(scope="module")
def _shared_sandbox(control_plane: ControlPlaneStub | None) -> Iterator[object | None]:
    """Real-sandbox mode: one sandbox per test module (creating one costs 0.1-1 s). Tests must not kill it."""
    if not REMOTE:
        yield None
        return
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=600, envs={"SECURED": "1"})  # the sandbox env var `secured` promises
    try:
        yield sbx
    finally:
        sbx.kill()


@pytest.fixture
def sandbox(control_plane: ControlPlaneStub | None, _shared_sandbox: object | None):  # type: ignore[no-untyped-def]
    if _shared_sandbox is not None:
        yield _shared_sandbox
        return
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=60)
    yield sbx
    sbx.kill()


@pytest.fixture
async def async_sandbox(control_plane: ControlPlaneStub | None, _shared_sandbox: object | None):  # type: ignore[no-untyped-def]
    from e2b import AsyncSandbox

    if _shared_sandbox is not None:
        yield await AsyncSandbox.connect(_shared_sandbox.sandbox_id)  # type: ignore[attr-defined]
        return
    sbx = await AsyncSandbox.create(timeout=60)
    yield sbx
    await sbx.kill()


@pytest.fixture
def home_dir(sandbox_user: str, _shared_sandbox: object | None) -> Iterator[str]:
    """A fresh directory under the user's home (relative name, absolute path), removed afterwards."""
    name = "t-" + uuid.uuid4().hex[:10]
    if _shared_sandbox is not None:
        path = f"/home/{sandbox_user}/{name}"
        yield path
        _shared_sandbox.commands.run(f"rm -rf {path}", user="root")  # type: ignore[attr-defined]
        return
    path = os.path.join(pwd.getpwnam(sandbox_user).pw_dir, name)
    yield path
    subprocess.run(["rm", "-rf", path], check=False)


@pytest.fixture
def secured(control_plane: ControlPlaneStub | None, _shared_sandbox: object | None,
            request: pytest.FixtureRequest) -> Iterator[Wire]:
    """Raw HTTP access to an agent that has an access token and the sandbox env var SECURED=1."""
    if _shared_sandbox is not None:
        yield wire_of(_shared_sandbox)
        return
    agent: AgentProcess = request.getfixturevalue("agent")
    token = secrets.token_hex(8)
    agent.init(token, {"SECURED": "1"})
    yield Wire(url=agent.url, token=token, routing={})
