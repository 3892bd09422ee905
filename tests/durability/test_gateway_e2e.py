"""Issue 4 end to end: an agent in a sandbox calls a model through the server's metering gateway while its
session is checkpointed, killed mid-call, resumed and forked; the provider's bill, the ledger and
`keepstate ledger reconcile` agree that each distinct call was made once.

The provider is the fake one, on 127.0.0.1 in this process; the sandbox reaches the gateway at its fixed address
(10.88.255.254), the gateway reaches the fake on the host's loopback.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2b import Sandbox

from keepstate.testing import FakeProvider, fake_provider_in_thread
from tests.sdk.sdkharness import KEEPSTATE, Server, free_port

from .conftest import Fleet, keepstate_env, sdk_opts

HOST_KEY = "sk-host-only"
OUT = "/home/user/out"

# The agent: plain urllib (the base template has no openai SDK). Deterministic bodies; each answer to a file.
# A request that dies with the sandbox's old network (a restore) times out and is sent again, marked as a retry
# the way the official SDKs mark theirs. With a gate, it stops after `wait_at` calls until the gate file exists.
AGENT = r"""
import json, os, sys, time, urllib.error, urllib.request

base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
n, out = int(sys.argv[1]), sys.argv[2]
wait_at, gate = (int(sys.argv[3]), sys.argv[4]) if len(sys.argv) > 4 else (-1, "")
os.makedirs(out, exist_ok=True)


def call(i):
    body = json.dumps({"model": "fake-gpt", "messages": [{"role": "user", "content": f"step {i}"}]}).encode()
    for attempt in range(200):
        req = urllib.request.Request(base + "/chat/completions", data=body, headers={
            "authorization": "Bearer " + key, "content-type": "application/json",
            "x-stainless-retry-count": str(attempt)})
        try:
            with urllib.request.urlopen(req, timeout=12) as r:
                doc = json.load(r)
                return {"step": i, "answer": doc["choices"][0]["message"]["content"],
                        "source": r.headers.get("x-keepstate-source"), "attempts": attempt + 1}
        except urllib.error.HTTPError as e:
            if e.code < 500 and e.code not in (408, 409, 429):
                raise
        except OSError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"step {i}: no answer")


for i in range(n):
    if i == wait_at:
        open(os.path.join(out, "waiting"), "w").close()
        while not os.path.exists(gate):
            time.sleep(0.1)
    answer = call(i)
    tmp = os.path.join(out, f".{i}.tmp")
    with open(tmp, "w") as f:
        json.dump(answer, f)
    os.replace(tmp, os.path.join(out, f"{i}.json"))
open(os.path.join(out, "done"), "w").close()
"""


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with fake_provider_in_thread(FakeProvider(api_key=HOST_KEY)) as f:
        yield f


def gateway_config(fake: FakeProvider, tmp_path: Path) -> Path:
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"version": 1, "models": {"fake-*": {"input": 1.0, "output": 2.0}}}))
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps({
        "providers": [{"name": "fake", "kind": "openai", "base_url": fake.openai_base_url, "api_key": HOST_KEY,
                       "models": ["fake-*"], "stats_url": fake.stats_url}],
        "price_table": str(prices),
    }))
    return path


def start_with_gateway(fleet: Fleet, config: Path) -> Server:
    return fleet.start(extra=("--gateway-config", str(config), "--gateway-port", str(free_port())))


def wait_for(what: str, pred: Callable[[], bool], limit: float = 180.0) -> None:
    deadline = time.monotonic() + limit
    while not pred():
        if time.monotonic() > deadline:
            # The usual cause: another server's firewall no longer lets sandboxes reach this gateway's port.
            rules = subprocess.run(["iptables", "-w", "-S", "KEEPSTATE-IN"], capture_output=True, text=True)
            raise TimeoutError(f"gave up waiting for {what}; sandbox firewall:\n{rules.stdout}{rules.stderr}")
        time.sleep(0.1)


def start_agent(sbx: Sandbox, n: int, *gate: str) -> None:
    assert sbx.commands.run("echo $OPENAI_BASE_URL").stdout.strip().startswith("http://10.88.255.254:")
    sbx.files.write("/home/user/agent.py", AGENT)
    sbx.commands.run(f"nohup python3 /home/user/agent.py {n} {OUT} {' '.join(gate)} >/home/user/agent.log 2>&1 &")


def answers(sbx: Sandbox, n: int) -> list[dict[str, Any]]:
    return [json.loads(sbx.files.read(f"{OUT}/{i}.json")) for i in range(n)]


def finished(sbx: Sandbox) -> Callable[[], bool]:
    """Whether the agent is done; fails at once if it died."""

    def check() -> bool:
        if sbx.files.exists(f"{OUT}/done"):
            return True
        log = sbx.commands.run("cat /home/user/agent.log; pgrep -f agent.py || echo AGENT-GONE").stdout
        assert "AGENT-GONE" not in log, log
        return False

    return check


def ks(srv: Server, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(KEEPSTATE), *args], env=keepstate_env(srv), capture_output=True, text=True,
                          timeout=120)


def ledger(srv: Server) -> list[dict[str, Any]]:
    done = ks(srv, "ledger", "--json")
    assert done.returncode == 0, done.stderr
    entries: list[dict[str, Any]] = json.loads(done.stdout)["entries"]
    return entries


def assert_reconciled(srv: Server, config: Path) -> None:
    done = ks(srv, "ledger", "reconcile", "--config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr


def test_agent_killed_mid_call_and_resumed_makes_each_call_once(fleet: Fleet, fake: FakeProvider,
                                                                tmp_path: Path) -> None:
    n = 6
    config = gateway_config(fake, tmp_path)
    srv = start_with_gateway(fleet, config)
    opts = sdk_opts(srv)
    sbx = Sandbox.create(timeout=600, **opts)
    fake.first_token_s = 3.0  # long enough that the checkpoint lands while a call is in flight
    start_agent(sbx, n)
    wait_for("the third call to reach the provider", lambda: finished(sbx)() or fake.stats().requests >= 3)
    assert not sbx.files.exists(f"{OUT}/2.json")  # step 2 is in flight
    sbx.pause()  # checkpointed, then the sandbox is gone: killed mid-call
    fake.first_token_s = 0.3
    resumed = Sandbox.connect(sbx.sandbox_id, **opts)
    try:
        wait_for("the resumed agent to finish", finished(resumed))
        got = answers(resumed, n)
    finally:
        resumed.kill()

    assert [a["step"] for a in got] == list(range(n))
    assert len({a["answer"] for a in got}) == n and all(a["answer"] for a in got)
    # the call in flight at the kill, made again, was answered from the store (or joined the upstream call,
    # which the gateway carried on after the sandbox was gone)
    assert {"store", "joined"} & {a["source"] for a in got}
    stats = fake.stats()
    assert stats.calls == n == stats.requests  # each distinct call made once, upstream

    entries = ledger(srv)
    upstream = [e for e in entries if e["kind"] == "upstream"]
    assert len(upstream) == n == len({e["call_key"] for e in upstream})
    assert all(e["outcome"] == "ok" and e["session_id"] == sbx.sandbox_id for e in upstream)
    assert sum(e["output_tokens"] for e in upstream) == stats.output_tokens
    assert sum(e["input_tokens"] for e in upstream) == stats.input_tokens
    originals = {e["entry_id"] for e in upstream}
    served = [e for e in entries if e["kind"] != "upstream"]
    assert served and all(e["cost_nano"] == 0 and e["original_entry_id"] in originals for e in served)
    assert_reconciled(srv, config)


def test_three_forks_reissuing_the_same_calls_diverge_each_in_its_own_session(fleet: Fleet, fake: FakeProvider,
                                                                             tmp_path: Path) -> None:
    n, forks_wanted = 3, 3
    config = gateway_config(fake, tmp_path)
    srv = start_with_gateway(fleet, config)
    opts = sdk_opts(srv)
    sbx = Sandbox.create(timeout=600, **opts)
    start_agent(sbx, n, "1", "/home/user/go")  # one call, then wait for the gate
    wait_for("the agent to wait at its gate", lambda: sbx.files.exists(f"{OUT}/waiting"))
    forks = sbx.fork(count=forks_wanted, timeout=300)
    try:
        assert all(isinstance(f, Sandbox) for f in forks), forks
        children: list[Sandbox] = [f for f in forks if isinstance(f, Sandbox)]
        for child in children:
            child.files.write("/home/user/go", "")
        for child in children:
            wait_for(f"fork {child.sandbox_id} to finish", finished(child))
        got = {child.sandbox_id: answers(child, n) for child in children}
    finally:
        for f in forks:
            if isinstance(f, Sandbox):
                f.kill()
        sbx.kill()

    # the parent made step 0; each fork made steps 1 and 2 again, upstream, with the same bodies
    stats = fake.stats()
    assert stats.calls == 1 + forks_wanted * (n - 1) == stats.requests
    for child_answers in got.values():
        assert [a["source"] for a in child_answers[1:]] == ["upstream"] * (n - 1)
    assert len({json.dumps([a["answer"] for a in c]) for c in got.values()}) == 1  # same calls, same answers

    entries = ledger(srv)
    assert all(e["kind"] == "upstream" for e in entries)
    by_session: dict[str, int] = {}
    for e in entries:
        by_session[e["session_id"]] = by_session.get(e["session_id"], 0) + 1
    assert by_session == {sbx.sandbox_id: 1, **{child: n - 1 for child in got}}
    assert len({e["call_key"] for e in entries}) == len(entries)
    assert_reconciled(srv, config)
