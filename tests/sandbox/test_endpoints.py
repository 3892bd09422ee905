"""E2B's calls beyond the SDK's everyday ones, on the fake runtime: refresh, the older resume, the v2 fork route,
metrics of many sandboxes, logs (v1 and v2) and templates. Every answer is also checked against docs/openapi.yaml
(KEEPSTATE_VALIDATE_RESPONSES)."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime

import pytest

from keepstate.sandbox import loops

from .conftest import Served
from .test_lifecycle import create
from .test_races import read_file, write_file


def error_of(status: int, body: object, code: int) -> str:
    assert status == code, (status, body)
    assert isinstance(body, dict) and body["code"] == code and isinstance(body["message"], str), body
    return body["message"]


async def test_refresh_extends_a_running_sandbox_and_never_shortens_it(served: Served) -> None:
    s = served
    sid, _ = await create(s, timeout=60)
    before = s.manager.records[sid].end_at
    assert (await s.call("POST", f"/sandboxes/{sid}/refreshes", {"duration": 1800}))[0] == 204
    extended = s.manager.records[sid].end_at
    assert extended >= time.time() + 1800 - 5 and extended > before
    assert (await s.call("POST", f"/sandboxes/{sid}/refreshes", {"duration": 10}))[0] == 204
    assert s.manager.records[sid].end_at == extended  # never shortened
    assert (await s.call("POST", f"/sandboxes/{sid}/refreshes"))[0] == 204  # no body: 15 s, here a no-op
    assert (await s.row(sid)).end_at == extended  # type: ignore[union-attr]
    for bad in ({"duration": 3601}, {"duration": -1}, {"duration": "60"}, {"duration": True}):
        assert "duration" in error_of(*await s.call("POST", f"/sandboxes/{sid}/refreshes", bad), 400)
    assert "JSON object" in error_of(*await s.call("POST", f"/sandboxes/{sid}/refreshes", [1]), 400)
    error_of(*await s.call("POST", "/sandboxes/nosuchsandbox0000000/refreshes", {"duration": 5}), 404)
    assert (await s.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204
    assert "paused" in error_of(*await s.call("POST", f"/sandboxes/{sid}/refreshes", {"duration": 5}), 409)
    assert (await s.call("DELETE", f"/sandboxes/{sid}"))[0] == 204


async def test_the_older_resume_resumes_only_a_paused_sandbox(served: Served) -> None:
    s = served
    sid, token = await create(s)
    await write_file(s, sid, token, "/home/user/kept", b"across the resume")
    assert "already running" in error_of(*await s.call("POST", f"/sandboxes/{sid}/resume", {}), 409)
    assert (await s.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204
    error_of(*await s.call("POST", f"/sandboxes/{sid}/resume", {"timeout": "soon"}), 400)
    error_of(*await s.call("POST", f"/sandboxes/{sid}/resume", {"autoPause": "yes"}), 400)
    error_of(*await s.call("POST", f"/sandboxes/{sid}/resume", {"memory": "no"}), 400)
    status, body = await s.call("POST", f"/sandboxes/{sid}/resume", {"timeout": 120, "autoPause": True})
    assert status == 201, body
    assert body["sandboxID"] == sid and body["envdAccessToken"] == token
    row = s.manager.records[sid]
    assert row.settings.auto_pause and (await s.row(sid)).settings.auto_pause  # type: ignore[union-attr]
    assert time.time() + 100 < row.end_at <= time.time() + 121
    assert await read_file(s, sid, token, "/home/user/kept") == b"across the resume"
    error_of(*await s.call("POST", "/sandboxes/nosuchsandbox0000000/resume", {}), 404)
    assert (await s.call("DELETE", f"/sandboxes/{sid}"))[0] == 204


async def test_concurrent_resumes_resume_once_and_refuse_the_rest(served: Served) -> None:
    s = served
    sid, _ = await create(s)
    assert (await s.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204
    answers = await asyncio.gather(*(s.call("POST", f"/sandboxes/{sid}/resume", {}) for _ in range(4)))
    assert sorted(status for status, _ in answers) == [201, 409, 409, 409], answers
    assert (await s.call("GET", f"/sandboxes/{sid}"))[1]["state"] == "running"
    assert (await s.call("DELETE", f"/sandboxes/{sid}"))[0] == 204


async def test_the_v2_fork_route_forks_and_refuses_cold_forks(served: Served) -> None:
    s = served
    sid, token = await create(s)
    await write_file(s, sid, token, "/home/user/f", b"parent's")
    status, forks = await s.call("POST", f"/v2/sandboxes/{sid}/fork", {"count": 2, "timeout": 60})
    assert status == 201 and len(forks) == 2, forks
    for f in forks:
        child = f["sandbox"]
        assert child["sandboxID"] != sid
        assert await read_file(s, child["sandboxID"], child["envdAccessToken"], "/home/user/f") == b"parent's"
        assert (await s.call("DELETE", f"/sandboxes/{child['sandboxID']}"))[0] == 204
    status, forks = await s.call("POST", f"/v2/sandboxes/{sid}/fork", {"memory": False})  # files only: a cold boot
    assert status == 201 and len(forks) == 1, forks
    child = forks[0]["sandbox"]
    assert await read_file(s, child["sandboxID"], child["envdAccessToken"], "/home/user/f") == b"parent's"
    error_of(*await s.call("POST", f"/v2/sandboxes/{sid}/fork", {"memory": "no"}), 400)
    error_of(*await s.call("POST", "/v2/sandboxes/nosuchsandbox0000000/fork", {"memory": False}), 404)
    assert (await s.call("DELETE", f"/sandboxes/{sid}"))[0] == 204


async def test_metrics_of_many_sandboxes(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    s = served
    monkeypatch.setattr(loops, "METRIC_INTERVAL", 0.05)
    a, _ = await create(s)
    b, _ = await create(s)
    deadline = time.monotonic() + 20
    while not (s.manager.metrics.get(a) and s.manager.metrics.get(b)):
        assert time.monotonic() < deadline, "no metrics sampled"
        await asyncio.sleep(0.05)
    status, body = await s.call("GET", f"/sandboxes/metrics?sandbox_ids={a},{b},nosuchsandbox0000000,{a}")
    assert status == 200, body
    assert set(body["sandboxes"]) == {a, b}
    assert body["sandboxes"][a]["memTotal"] > 0
    error_of(*await s.call("GET", "/sandboxes/metrics"), 400)
    error_of(*await s.call("GET", "/sandboxes/metrics?sandbox_ids=" + ",".join(f"s{i}" for i in range(101))), 400)
    for sid in (a, b):
        assert (await s.call("DELETE", f"/sandboxes/{sid}"))[0] == 204
    status, body = await s.call("GET", f"/sandboxes/metrics?sandbox_ids={a}")
    assert status == 200 and body == {"sandboxes": {}}


async def test_logs_tell_a_sandboxs_story_and_outlive_it(served: Served) -> None:
    s = served
    sid, token = await create(s)
    await write_file(s, sid, token, "/home/user/notes.txt", b"hello")
    assert (await s.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204  # the pause pulls the agent's journal first
    assert (await s.call("POST", f"/sandboxes/{sid}/connect", {"timeout": 60}))[0] == 201
    assert (await s.call("DELETE", f"/sandboxes/{sid}"))[0] == 204

    status, v1 = await s.call("GET", f"/sandboxes/{sid}/logs")
    assert status == 200, v1
    messages = [e["message"] for e in v1["logEntries"]]
    assert [line["line"] for line in v1["logs"]] == messages
    story = ["sandbox created from template base", "wrote /home/user/notes.txt (5 bytes)", "paused (checkpoint",
             "resumed from checkpoint", "sandbox killed (kill)"]
    at = [next(i for i, m in enumerate(messages) if m.startswith(part)) for part in story]
    assert at == sorted(at), messages  # in the order it happened
    entry = v1["logEntries"][at[1]]
    assert entry["level"] == "debug" and entry["fields"]["kind"] == "file.write"
    assert entry["fields"]["path"] == "/home/user/notes.txt" and entry["fields"]["size"] == "5"
    stamps = [datetime.fromisoformat(e["timestamp"]) for e in v1["logEntries"]]
    assert stamps == sorted(stamps)

    status, v2 = await s.call("GET", f"/v2/sandboxes/{sid}/logs")
    assert status == 200 and v2["logs"] == v1["logEntries"]
    newest_first = (await s.call("GET", f"/v2/sandboxes/{sid}/logs?direction=backward&limit=2"))[1]["logs"]
    assert [e["message"] for e in newest_first] == messages[::-1][:2]
    info_up = (await s.call("GET", f"/v2/sandboxes/{sid}/logs?level=info"))[1]["logs"]
    assert info_up and all(e["level"] in ("info", "warn", "error") for e in info_up)
    assert not any(e["fields"]["kind"] == "file.write" for e in info_up)
    found = (await s.call("GET", f"/v2/sandboxes/{sid}/logs?search=notes.txt"))[1]["logs"]
    assert [e["fields"]["kind"] for e in found] == ["file.write"]
    # A cursor one millisecond after an entry's time starts after it.
    pause_ms = int(stamps[at[2]].timestamp() * 1000)
    later = (await s.call("GET", f"/v2/sandboxes/{sid}/logs?cursor={pause_ms + 1}"))[1]["logs"]
    assert later and all(datetime.fromisoformat(e["timestamp"]) > stamps[at[2]] for e in later)
    assert [e["message"] for e in later][-1] == "sandbox killed (kill)"
    assert (await s.call("GET", f"/sandboxes/{sid}/logs?start={pause_ms + 1}&limit=1"))[1]["logs"][0]["line"] \
        == later[0]["message"]


@pytest.mark.parametrize("query", ["limit=1001", "limit=-1", "limit=x", "cursor=-5", "direction=up", "level=trace",
                                   "search=" + "a" * 257])
async def test_bad_log_queries_are_400(served: Served, query: str) -> None:
    s = served
    sid, _ = await create(s)
    error_of(*await s.call("GET", f"/v2/sandboxes/{sid}/logs?{query}"), 400)
    error_of(*await s.call("GET", "/v2/sandboxes/nosuchsandbox0000000/logs"), 404)
    error_of(*await s.call("GET", "/sandboxes/nosuchsandbox0000000/logs"), 404)
    error_of(*await s.call("GET", f"/sandboxes/{sid}/logs?limit=10001"), 400)
    assert (await s.call("DELETE", f"/sandboxes/{sid}"))[0] == 204


async def test_templates_are_listed_and_found_by_alias(served: Served) -> None:
    s = served
    status, listed = await s.call("GET", "/templates")
    assert status == 200, listed
    by_name = {t["templateID"]: t for t in listed}
    assert set(by_name) == {"base", "code-interpreter-v1"}
    assert by_name["base"]["buildStatus"] == "ready" and by_name["base"]["aliases"] == ["base"]
    spawned = by_name["base"]["spawnCount"]
    sid, _ = await create(s)
    after = {t["templateID"]: t for t in (await s.call("GET", "/templates"))[1]}
    assert after["base"]["spawnCount"] == spawned + 1 and after["base"]["lastSpawnedAt"] is not None
    assert (await s.call("GET", "/v2/templates")) == (200, list(after.values()))  # newer SDKs' route, same answer
    status, defaults = await s.call("GET", "/default-templates")  # the server's own: both TOML definitions
    assert status == 200 and {t["templateID"] for t in defaults} == {"base", "code-interpreter-v1"}
    status, detail = await s.call("GET", "/templates/base?limit=10")  # E2B's TemplateWithBuilds
    assert status == 200 and detail["templateID"] == "base" and detail["spawnCount"] == spawned + 1
    assert [b["buildID"] for b in detail["builds"]] == [after["base"]["buildID"]]
    assert detail["builds"][0]["status"] == "ready"
    from e2b.api.client.models import TemplateWithBuilds  # the stock SDK's model reads it

    assert TemplateWithBuilds.from_dict(detail).builds[0].build_id.hex == detail["buildID"].replace("-", "")
    status, body = await s.call("GET", "/templates/no-such-template")
    assert status == 404 and "no-such-template" in body["message"]
    assert after["code-interpreter-v1"]["spawnCount"] == by_name["code-interpreter-v1"]["spawnCount"]

    assert await s.call("GET", "/templates/aliases/base") == (200, {"templateID": "base", "public": True})
    assert "nosuch" in error_of(*await s.call("GET", "/templates/aliases/nosuch"), 404)
    status, snap = await s.call("POST", f"/sandboxes/{sid}/snapshots", {"name": "my-snap"})
    assert status == 201, snap
    assert await s.call("GET", "/templates/aliases/my-snap") == (200, {"templateID": snap["snapshotID"],
                                                                       "public": False})
    assert (await s.call("DELETE", f"/sandboxes/{sid}"))[0] == 204
