"""examples/computer_use.py end to end: its own server and gateway, the scripted fake model, a real desktop. The agent
opens a terminal, types a command that writes a file, and says it is done; every model call went through the
gateway once (the ledger's upstream calls equal the provider's own count and the agent's calls)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sdkharness import DOMAIN, REPO

pytest.importorskip("e2b_desktop", reason="e2b-desktop is installed in the main venv only (pyproject's test extra)")
pytest.importorskip("openai", reason="the example's model client")
pytestmark = pytest.mark.skipif(DOMAIN is not None, reason="the example starts a server of its own: the main pass "
                                                           "runs it, the by-domain pass need not again")


def test_the_computer_use_example_drives_a_desktop_through_the_gateway() -> None:
    done = subprocess.run([sys.executable, str(REPO / "examples" / "computer_use.py"), "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert [a["action"] for a in out["actions"]] == ["launch", "type", "key"], out
    assert out["actions"][0]["outcome"] == "xfce4-terminal is open"
    assert out["file"] == "hello from a computer-use agent\n"
    assert out["summary"] == "wrote /tmp/agent.txt from a terminal"
    assert out["model_calls"] == 4
    assert out["ledger"]["upstream_calls"] == out["provider_calls"] == 4, out
