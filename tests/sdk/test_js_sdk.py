"""The stock E2B JS SDK (`e2b` from npm, pinned in tests/js/package-lock.json) against the session's server: one
`node --test` process runs the scenarios of tests/js/*.test.mjs, concurrently where they are independent."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import signal
import subprocess
import time

import pytest

from sdkharness import REPO, Server, apply_env, client_env

JS = REPO / "tests" / "js"
NODE_DEADLINE = 240  # seconds; the scenarios take well under a minute


def _older_python_sdk() -> str | None:
    """The pin this interpreter's Python SDK matches in tests/requirements-e2b*.txt (the venvs in which
    scripts/test.sh runs tests/sdk again with older Python SDKs), or None (the main pass)."""
    try:
        pin = f"e2b=={importlib.metadata.version('e2b')}"
    except importlib.metadata.PackageNotFoundError:
        return None
    for requirements in (REPO / "tests").glob("requirements-e2b*.txt"):
        if pin in requirements.read_text().split():
            return pin
    return None


# The JS SDK does not depend on which Python SDK is installed: the scenarios run once, in the main pass.
OLDER_PYTHON_SDK = _older_python_sdk()
pytestmark = pytest.mark.skipif(OLDER_PYTHON_SDK is not None,
                                reason=f"the JS SDK tests run in the main pass, not this one of {OLDER_PYTHON_SDK}")


def test_js_sdk_scenarios(server: Server) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (scripts/setup-host.sh installs Debian's nodejs: `make setup`)")
    if not (JS / "node_modules" / "e2b").is_dir():
        pytest.skip("tests/js/node_modules is absent (`make setup` runs `npm ci` in tests/js)")
    files = sorted(str(p.relative_to(REPO)) for p in JS.glob("*.test.mjs"))
    assert files, f"no *.test.mjs in {JS}"
    env = apply_env(client_env(server.url, server.key),
                    {**os.environ, "KEEPSTATE_TEST_API": server.url, "NO_PROXY": "127.0.0.1,localhost"})
    env.pop("E2B_DEBUG", None)
    # `node --test` runs each file in a child process: a session of its own lets a deadline end them all.
    proc = subprocess.Popen([node, "--test", "--test-reporter=spec", *files], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    started = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=NODE_DEADLINE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"node --test did not finish in {NODE_DEADLINE} s; its output:\n{out.decode(errors='replace')}")
    text = out.decode(errors="replace")
    print(f"node --test took {time.monotonic() - started:.1f} s:\n{text}")
    assert proc.returncode == 0, f"node --test exited with {proc.returncode}; its output:\n{text}"
