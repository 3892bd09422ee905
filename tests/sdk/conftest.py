"""SDK tests: the stock `e2b` SDK against a real KeepState server and real gVisor sandboxes.

These tests import no `keepstate` code, so they also run in the e2b==2.50.0 venv. They use
the server named by KEEPSTATE_TEST_API/KEEPSTATE_TEST_KEY (scripts/test.sh starts one for
the whole run) or start their own for the session.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest

from sdkharness import Server, apply_env, client_env, make_key, start_server


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    api, key = os.environ.get("KEEPSTATE_TEST_API"), os.environ.get("KEEPSTATE_TEST_KEY")
    if api and key:
        yield Server(url=api, key=key, home=os.environ.get("KEEPSTATE_TEST_HOME", ""))
        return
    home = tempfile.mkdtemp(prefix="keepstate-sdk-")
    srv = start_server(home, extra=("--reap-on-exit",))
    srv.key = make_key(home)
    try:
        yield srv
    finally:
        assert srv.proc is not None
        srv.proc.terminate()
        srv.proc.wait(timeout=60)


@pytest.fixture(scope="session", autouse=True)
def e2b_env(server: Server) -> None:
    apply_env(client_env(server.url, server.key))
    os.environ.pop("E2B_DEBUG", None)
    os.environ["NO_PROXY"] = "127.0.0.1,localhost"


@pytest.fixture(scope="module")
def sandbox(e2b_env: None) -> Iterator["object"]:
    """One sandbox shared by a test module (tests must not kill it)."""
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=600)
    try:
        yield sbx
    finally:
        sbx.kill()


@pytest.fixture
def new_sandbox(e2b_env: None) -> Iterator["object"]:
    """A factory of fresh sandboxes, each killed at the end of the test."""
    from e2b import Sandbox

    made: list[Sandbox] = []

    def make(**kw: object) -> Sandbox:
        kw.setdefault("timeout", 300)
        sbx = Sandbox.create(**kw)
        made.append(sbx)
        return sbx

    yield make
    for sbx in made:
        try:
            sbx.kill()
        except Exception:
            pass
