"""The metering gateway's provider keys never enter a sandbox: not its environment, not a process's command line,
not a file, not an answer from the gateway, even after a call through it that the gateway made with the key. And
the secrets key given in the server's environment (KEEPSTATE_SECRETS_KEY) reaches no process the server starts.

A real server with `--gateway-config` (one key inline in the config file, one from the server's environment via
`api_key_env`), a real gVisor sandbox, the fake provider on 127.0.0.1. The scanner in the sandbox gets the keys as
hex, so that no process there ever holds them in its arguments.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox

from keepstate.testing import FakeProvider, fake_provider_in_thread
from tests.sdk.sdkharness import SCAN, Server, free_port, make_key, start_server

INLINE_KEY = "sk-inline-" + secrets.token_hex(16)
ENV_KEY = "sk-env-" + secrets.token_hex(16)
ENV_NAME = "KEEPSTATE_TEST_ANTHROPIC_KEY"
SECRETS_KEY = base64.b64encode(secrets.token_bytes(32)).decode()

CALL = r"""
import json, os, urllib.request

body = json.dumps({"model": "fake-gpt", "messages": [{"role": "user", "content": "hello"}]}).encode()
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body, headers={
    "authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as r:
    answer = r.read()
with open("/home/user/answer.json", "wb") as f:
    f.write(answer)
print(json.loads(answer)["choices"][0]["message"]["content"] != "")
"""


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone
        return False


def host_pids_whose_environ_has(needle: bytes, but: int, settle: float = 2.0) -> list[int]:
    """Processes other than `but` that keep `needle` in their environment. A child the server has forked but not
    yet exec'd (its conntrack, nft, ip: every few seconds) shows the server's initial environment until its exec,
    so a holder seen once is looked at again until `settle` seconds have passed: one that still holds it is one."""
    found = [pid for pid in (int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit())
             if pid != but and _environ_has(pid, needle)]
    deadline = time.monotonic() + settle
    while found and time.monotonic() < deadline:
        time.sleep(0.1)
        found = [pid for pid in found if _environ_has(pid, needle)]
    return found


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with fake_provider_in_thread(FakeProvider(api_key=INLINE_KEY)) as f:
        yield f


@pytest.fixture
def server(fake: FakeProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"version": 1, "models": {"fake-*": {"input": 1.0, "output": 2.0},
                                                           "claude-fake*": {"input": 1.0, "output": 2.0}}}))
    config = tmp_path / "gateway.json"
    config.write_text(json.dumps({
        "providers": [{"name": "fake", "kind": "openai", "base_url": fake.openai_base_url, "api_key": INLINE_KEY,
                       "models": ["fake-*"]},
                      {"name": "fake-anthropic", "kind": "anthropic", "base_url": fake.anthropic_base_url,
                       "api_key_env": ENV_NAME, "models": ["claude-fake*"]}],
        "price_table": str(prices),
    }))
    monkeypatch.setenv(ENV_NAME, ENV_KEY)  # the server's environment, as an operator would give it
    monkeypatch.setenv("KEEPSTATE_SECRETS_KEY", SECRETS_KEY)
    home = tempfile.mkdtemp(prefix="keepstate-gateway-keys-")
    srv = start_server(home, pool=0, extra=("--reap-on-exit", "--gateway-config", str(config), "--gateway-port",
                                            str(free_port())))
    srv.key = make_key(home)
    monkeypatch.delenv("KEEPSTATE_SECRETS_KEY")
    try:
        yield srv
    finally:
        assert srv.proc is not None
        if srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGTERM)
            srv.proc.wait(timeout=120)


def test_provider_keys_never_enter_a_sandbox(server: Server, fake: FakeProvider) -> None:
    sbx = Sandbox.create(timeout=600, api_key=server.key, api_url=server.url, sandbox_url=server.url)
    try:
        env = sbx.commands.run("env").stdout
        assert "OPENAI_API_KEY=" in env and "ANTHROPIC_API_KEY=" in env  # the gateway's own per-run token
        assert INLINE_KEY not in env and ENV_KEY not in env and ENV_NAME not in env
        sbx.files.write("/home/user/call.py", CALL)
        assert sbx.commands.run("python3 /home/user/call.py", timeout=120).stdout.strip() == "True"
        assert fake.stats().calls == 1  # the gateway called the provider, with its key (the fake checks it)
        answer = sbx.files.read("/home/user/answer.json")
        assert INLINE_KEY not in answer and ENV_KEY not in answer
        sbx.files.write("/home/user/scan.py", SCAN)
        hexes = f"{INLINE_KEY.encode().hex()} {ENV_KEY.encode().hex()}"
        out = sbx.commands.run(f"python3 /home/user/scan.py {hexes}", timeout=600).stdout
        scan = json.loads(out.strip().splitlines()[-1])
        assert scan["found"] == [], scan["found"]
        assert scan["files"] > 1000, scan  # it did walk the filesystem (the base image has many thousand files)
        # On the host, while the sandbox runs: only the server's own initial environment holds the secrets key
        # (it drops it from its environment at start, so runsc and every other child starts without it).
        assert server.proc is not None
        holders = host_pids_whose_environ_has(SECRETS_KEY.encode(), but=server.proc.pid)
        assert holders == [], [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in holders]
        # Nor the provider key from the server's environment: runsc (its gofer and sandbox, alive as long as the
        # sandbox) starts with PATH only, and the server drops the variable once read, so that its short-lived
        # tools (nft, ip, conntrack) do not inherit it either (a fresh-clone run caught `nft -j list counters`).
        holders = host_pids_whose_environ_has(ENV_KEY.encode(), but=server.proc.pid)
        assert holders == [], [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in holders]
    finally:
        sbx.kill()
    # On the host: the keys are not in the server's log nor in its database (the gateway's ledger included): every
    # SQLite file of its data directory, keepstate.sqlite and its WAL (and any file of a release before it).
    home = Path(server.home)
    files = sorted(home.glob("*.sqlite*"))
    assert os.environ.get("KEEPSTATE_DB") or home / "keepstate.sqlite" in files, files
    for path in [home / "server.log", *files]:
        data = path.read_bytes()
        assert INLINE_KEY.encode() not in data and ENV_KEY.encode() not in data, path
