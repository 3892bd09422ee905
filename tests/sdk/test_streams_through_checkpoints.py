"""A snapshot and a fork close every connection into the sandbox (gVisor's restored netstack would wedge on one);
the client's streams must not notice: a foreground command's output and a background command's handle come through
whole and in order (docs/design/resumable-streams.md). Before, both broke."""

from __future__ import annotations

import json
import threading
import urllib.request

from e2b import Sandbox

from sdkharness import wait_until

LINES = 60


def _post(server, path: str, body: dict) -> dict:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"X-API-KEY": server.key, "Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=120) as r:
        return json.loads(r.read())


def _counting(name: str) -> str:
    # a line every 50 ms: the stream is open across both checkpoints below
    return f"touch /tmp/{name}.started; for i in $(seq 1 {LINES}); do echo {name}-$i; sleep 0.05; done"


def test_command_streams_run_through_a_snapshot_and_a_fork(new_sandbox, server) -> None:
    sbx: Sandbox = new_sandbox()
    background = sbx.commands.run(_counting("bg"), background=True)
    foreground: dict[str, object] = {}

    def run() -> None:
        try:
            foreground["result"] = sbx.commands.run(_counting("fg"), timeout=120)
        except Exception as e:  # noqa: BLE001 - the test reports it
            foreground["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: sbx.files.exists("/tmp/fg.started") and sbx.files.exists("/tmp/bg.started"), 20,
               "both commands to start")
    snapshot = _post(server, f"/sandboxes/{sbx.sandbox_id}/snapshots", {})  # cuts every connection into it
    forks = _post(server, f"/sandboxes/{sbx.sandbox_id}/fork", {"count": 1})  # and again
    for child in forks:
        Sandbox.kill(child["sandbox"]["sandboxID"])
    thread.join(120)
    assert "error" not in foreground, f"the foreground command's stream broke: {foreground.get('error')!r}"
    result = foreground["result"]
    assert result.exit_code == 0  # type: ignore[attr-defined]
    assert result.stdout.split() == [f"fg-{i}" for i in range(1, LINES + 1)]  # type: ignore[attr-defined]
    done = background.wait()
    assert done.exit_code == 0 and done.stdout.split() == [f"bg-{i}" for i in range(1, LINES + 1)]
    assert snapshot["snapshotID"]
