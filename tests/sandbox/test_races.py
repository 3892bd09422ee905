"""Concurrent lifecycle commands on one sandbox, as a user's agent fires them: pause, snapshot, fork, connect, pause,
a network update and a kill (or a timeout of 0) at the same moment, 50 rounds, on the fake runtime (on SQLite and on
PostgreSQL) and on gVisor.

Every answer is a success or a JSON 4xx, never a 5xx or a hang; afterwards the list, the info call and the
runtime agree on one state, and a sandbox left paused resumes with its files.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import pytest

from keepstate.sandbox.state import State
from keepstate.testing import FakeRuntime

from .conftest import Served

ROUNDS = 50
DENIED = "198.51.100.13"  # a documentation address: only named in a policy, never sent to


async def write_file(s: Served, sid: str, token: str, path: str, data: bytes) -> None:
    form = aiohttp.FormData()
    form.add_field("file", data, filename=path.rsplit("/", 1)[-1])
    async with s.http.post(f"{s.url}/files", params={"path": path, "username": "user"}, data=form,
                           headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token}) as r:
        assert r.status == 200, await r.text()


async def read_file(s: Served, sid: str, token: str, path: str) -> bytes:
    async with s.http.get(f"{s.url}/files", params={"path": path, "username": "user"},
                          headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token}) as r:
        assert r.status == 200, await r.text()
        return await r.read()


def check_answer(what: str, status: int, body: Any) -> None:
    assert status < 500, f"{what}: {status} {body}"
    if status >= 400:
        assert isinstance(body, dict) and body.get("code") == status and isinstance(body.get("message"), str), \
            f"{what}: {status} is not the JSON error shape: {body!r}"
    if what == "fork" and status == 201:
        for item in body:
            assert "sandbox" in item or item["error"]["code"] < 500, f"fork child failed: {item}"


async def agree(s: Served, sid: str) -> str:
    """The state the info call, the list and the runtime all report: "running", "paused" or "gone"."""
    status, info = await s.call("GET", f"/sandboxes/{sid}")
    _, listed = await s.call("GET", "/v2/sandboxes?state=running,paused&limit=100")
    in_list = {x["sandboxID"]: x["state"] for x in listed}
    row = s.manager.records.get(sid)
    if status == 404:
        assert sid not in in_list and row is None
        return "gone"
    assert status == 200 and in_list.get(sid) == info["state"], (info, in_list.get(sid))
    assert row is not None
    if info["state"] == "running":
        assert row.state == State.RUNNING and row.runtime_name
        assert await asyncio.to_thread(s.runtime.state, row.runtime_name) == "running"
    else:
        assert row.state == State.PAUSED and not row.runtime_name
        if row.settings.standby is not None:
            assert await asyncio.to_thread(s.runtime.state, row.settings.standby.name) == "paused"
    return str(info["state"])


async def one_round(s: Served, n: int) -> dict[str, int]:
    status, sbx = await s.call("POST", "/sandboxes", {"templateID": "base", "timeout": 120})
    assert status == 201, sbx
    sid, token = sbx["sandboxID"], sbx["envdAccessToken"]
    content = f"round {n}".encode()
    await write_file(s, sid, token, "/home/user/round.txt", content)
    ending = ("kill", "DELETE", f"/sandboxes/{sid}", None) if n % 2 == 0 else \
        ("timeout", "POST", f"/sandboxes/{sid}/timeout", {"timeout": 0})
    calls = [("pause", "POST", f"/sandboxes/{sid}/pause", None),
             ("snapshot", "POST", f"/sandboxes/{sid}/snapshots", {}),
             ("fork", "POST", f"/sandboxes/{sid}/fork", {"count": 1, "timeout": 60}),
             ("connect", "POST", f"/sandboxes/{sid}/connect", {"timeout": 120}),
             ("pause", "POST", f"/sandboxes/{sid}/pause", None),
             ("network", "PUT", f"/sandboxes/{sid}/network", {"denyOut": [DENIED]}),
             ending]
    random.Random(n).shuffle(calls)  # each round contests the lock in another order (seeded: reproducible)
    answers = await asyncio.wait_for(asyncio.gather(*(s.call(m, p, b) for _, m, p, b in calls)), timeout=240)
    seen: dict[str, int] = {}
    for (what, *_), (status, body) in zip(calls, answers, strict=True):
        check_answer(what, status, body)
        seen[f"{what} {status}"] = seen.get(f"{what} {status}", 0) + 1
        if what == "fork" and status == 201:
            for item in body:
                if "sandbox" in item:
                    await s.call("DELETE", f"/sandboxes/{item['sandbox']['sandboxID']}")
        if what == "snapshot" and status == 201:
            await s.call("DELETE", f"/templates/{body['snapshotID']}")
    state = await agree(s, sid)
    if state != "gone":  # the network update took effect whole or not at all, and outlived any pause after it
        status, info = await s.call("GET", f"/sandboxes/{sid}")
        expected = [DENIED] if seen.get("network 204") else []
        assert status == 200 and info["network"]["denyOut"] == expected, (seen, info["network"])
    if state == "paused":
        status, body = await s.call("POST", f"/sandboxes/{sid}/connect", {"timeout": 60})
        assert status == 201, body
        assert await read_file(s, sid, token, "/home/user/round.txt") == content
        assert await agree(s, sid) == "running"
    if state != "gone":
        status, body = await s.call("DELETE", f"/sandboxes/{sid}")
        assert status == 204, body
    assert await agree(s, sid) == "gone"
    return seen


@pytest.mark.parametrize("served", ["fake", "fake-postgresql", "gvisor"], indirect=True)
@pytest.mark.timeout(1500)
async def test_concurrent_lifecycle_commands_on_one_sandbox(served: Served) -> None:
    if isinstance(served.runtime, FakeRuntime):  # as slow as a small gVisor checkpoint, so commands overlap
        served.runtime.delay.update({"checkpoint": 0.05, "freeze": 0.01, "restore": 0.03})
    totals: dict[str, int] = {}
    for n in range(ROUNDS):
        for k, v in (await one_round(served, n)).items():
            totals[k] = totals.get(k, 0) + v
    # The races were real: both outcomes of a contested pause were seen, and some command lost to a kill.
    assert totals.get("pause 204", 0) >= ROUNDS // 2 and totals.get("pause 409", 0) > 0, totals
    assert any(k.endswith(" 404") for k in totals), totals
    if isinstance(served.runtime, FakeRuntime):
        assert served.runtime.violations == []  # no checkpoint was taken with a connection open
    await served.manager.instances.drain()
    leftover = {r.sandbox_id for r in served.manager.records.values()}
    assert not leftover, leftover
