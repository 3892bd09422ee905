"""A snapshot and a fork close every connection into the sandbox (gVisor's restored netstack would wedge on one);
the client must not notice: a foreground command's output and a background command's handle come through whole and
in order, and one-shot calls made all along (writes, reads, stats) all succeed, once each
(docs/design/resumable-streams.md). Before, the streams broke and a call could get a 502."""

from __future__ import annotations

import json
import threading
import urllib.request

from e2b import Sandbox

from sdkharness import wait_until

LINES = 100


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

    stop, unary = threading.Event(), {"done": 0, "errors": []}

    def files() -> None:  # one-shot calls (a write, a read, a stat) all along: none may fail for a snapshot
        i = 0
        while not stop.is_set():
            i += 1
            try:
                sbx.files.write(f"/tmp/u{i}", str(i))
                assert sbx.files.read(f"/tmp/u{i}") == str(i) and sbx.files.exists(f"/tmp/u{i}")
                unary["done"] += 1  # type: ignore[operator]
            except Exception as e:  # noqa: BLE001 - the test reports it
                unary["errors"].append(repr(e))  # type: ignore[union-attr]

    thread = threading.Thread(target=run)
    thread.start()
    caller = threading.Thread(target=files)
    caller.start()
    wait_until(lambda: sbx.files.exists("/tmp/fg.started") and sbx.files.exists("/tmp/bg.started"), 20,
               "both commands to start")
    snapshots = [_post(server, f"/sandboxes/{sbx.sandbox_id}/snapshots", {})  # each cuts every connection into it
                 for _ in range(3)]
    forks = _post(server, f"/sandboxes/{sbx.sandbox_id}/fork", {"count": 1})  # and again
    for child in forks:
        Sandbox.kill(child["sandbox"]["sandboxID"])
    thread.join(120)
    stop.set()
    caller.join(60)
    assert unary["errors"] == [] and unary["done"], unary
    assert "error" not in foreground, f"the foreground command's stream broke: {foreground.get('error')!r}"
    result = foreground["result"]
    assert result.exit_code == 0  # type: ignore[attr-defined]
    assert result.stdout.split() == [f"fg-{i}" for i in range(1, LINES + 1)]  # type: ignore[attr-defined]
    done = background.wait()
    assert done.exit_code == 0 and done.stdout.split() == [f"bg-{i}" for i in range(1, LINES + 1)]
    assert all(snap["snapshotID"] for snap in snapshots)
