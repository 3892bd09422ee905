"""Admission with the stock SDK and real gVisor sandboxes (docs/design/admission.md), on a server of its own that
runs one start at a time with one waiting: a burst of creates gets sandboxes or the busy 503 (never a 500), and an
API key with a limit of 2 gets the 429 on its third.

The burst asks the SDK not to retry (`retries=0`), so that every refusal reaches the caller as it is: the SDK
would otherwise wait `Retry-After` and try again (e2b 2.63), and a retry sent with little of its request timeout
left could end as a client-side timeout instead. What the retries achieve is measured in docs/design/admission.md."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from e2b import RateLimitException, Sandbox, ServiceBusyException

from sdkharness import KEEPSTATE, make_key, start_server

BURST = 8


def health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        return dict(json.load(r))


def test_a_burst_is_started_or_refused_busy_and_a_keys_limit_is_a_429(e2b_env: None) -> None:
    home = tempfile.mkdtemp(prefix="keepstate-admission-")
    srv = start_server(home, pool=0, extra=("--max-starts", "1", "--start-queue", "1", "--start-wait", "20",
                                            "--reap-on-exit"))
    opts = {"api_key": make_key(home), "api_url": srv.url, "sandbox_url": srv.url}
    made: list[Sandbox] = []

    def create(**kw: Any) -> Sandbox | Exception:
        try:
            sbx = Sandbox.create(timeout=120, **{**opts, **kw})
        except Exception as exc:  # noqa: BLE001 - every outcome is looked at below
            return exc
        made.append(sbx)
        return sbx

    try:
        with ThreadPoolExecutor(BURST) as pool:
            results = list(pool.map(lambda _: create(retries=0), range(BURST)))
        for r in results:
            if not isinstance(r, Sandbox):
                assert isinstance(r, ServiceBusyException), repr(r)  # a 503, never a 500
                assert "busy starting sandboxes" in str(r) and "retry in" in str(r), str(r)
        assert any(isinstance(r, Sandbox) for r in results), results
        assert any(isinstance(r, ServiceBusyException) for r in results), results  # 8 at once: 1 runs, 1 waits
        starts = health(srv.url)["admission"]["starts"]
        assert starts["limit"] == 1 and starts["queue"] == 1 and starts["refused"] >= 1, starts
        assert starts["running"] == 0 and starts["waiting"] == 0, starts
        for sbx in made:
            assert sbx.commands.run("echo up").stdout == "up\n"
            sbx.kill()
        made.clear()

        env = {**os.environ, "KEEPSTATE_HOME": home}
        limited = subprocess.check_output([str(KEEPSTATE), "keys", "create", "limited", "--max-sandboxes", "2"],
                                          env=env, stderr=subprocess.DEVNULL).decode().strip()
        assert all(isinstance(create(api_key=limited), Sandbox) for _ in range(2))
        third = create(api_key=limited)
        assert isinstance(third, RateLimitException), repr(third)
        assert "API key 'limited' has reached its limit of 2 running sandboxes (2 running" in str(third), str(third)
    finally:
        for sbx in made:
            try:
                sbx.kill()
            except Exception:  # noqa: BLE001 - the server reaps what is left as it stops
                pass
        assert srv.proc is not None
        srv.proc.terminate()
        srv.proc.wait(timeout=60)
