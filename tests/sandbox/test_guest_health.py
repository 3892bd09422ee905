"""Guest-health-aware pauses (E2B SDK 2.63; issue 28): a pause asks the sandbox's agent first. One that does not
answer is recorded on the pause (`envdUnresponsiveAtPause`), and a resume with memory is then refused with 409
`sandbox_snapshot_guest_agent_unresponsive` (restoring that memory would bring the hung agent back); with
`requireHealthyGuest` the pause is refused with 503 and the sandbox runs on. A healthy pause is unmarked. What E2B's
409 asks for, a reboot from files (`memory: false`, on_resume="reboot"), keeps the files and boots anew."""

from __future__ import annotations

import pytest

from keepstate.sandbox import agent_client
from keepstate.sandbox.instances import handle_of

from .conftest import serving
from .test_races import read_file, write_file


async def test_an_unresponsive_agent_is_recorded_on_the_pause_or_refuses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_client, "HEALTH_TIMEOUT", 0.3)
    async with serving(pool_size=0) as s:
        status, made = await s.call("POST", "/sandboxes", {"templateID": "base", "timeout": 300})
        assert status == 201, made
        sid = made["sandboxID"]
        await write_file(s, sid, made["envdAccessToken"], "/home/user/kept.txt", b"through the reboot")
        s.runtime.idle_freeze(handle_of(s.manager.records[sid]))  # its agent hangs (not the idle freezer's doing)

        status, body = await s.call("POST", f"/sandboxes/{sid}/pause", {"requireHealthyGuest": True})
        assert status == 503 and "does not answer" in body["message"], body
        status, info = await s.call("GET", f"/sandboxes/{sid}")
        assert info["state"] == "running" and "envdUnresponsiveAtPause" not in info  # it runs on, unpaused

        status, body = await s.call("POST", f"/sandboxes/{sid}/pause", {"memory": False})
        assert status == 503, body  # a filesystem-only pause needs the agent, always

        assert (await s.call("POST", f"/sandboxes/{sid}/pause", {}))[0] == 204  # by default: paused, and marked
        status, info = await s.call("GET", f"/sandboxes/{sid}")
        assert info["state"] == "paused" and info["pauseMode"] == "full" and info["envdUnresponsiveAtPause"] is True
        status, body = await s.call("POST", f"/v2/sandboxes/{sid}/connect", {"timeout": 60})
        assert status == 409 and body["error_code"] == "sandbox_snapshot_guest_agent_unresponsive", body
        assert (await s.call("GET", f"/sandboxes/{sid}"))[1]["state"] == "paused"

        # What the SDK does next (on_resume="reboot"): the files out of the paused state, by the runtime (the agent
        # does not answer), then a new boot with them.
        exports = s.runtime.calls.get("export_files", 0)
        status, body = await s.call("POST", f"/v2/sandboxes/{sid}/connect", {"timeout": 60, "memory": False})
        assert status == 201, body
        assert s.runtime.calls["export_files"] == exports + 1
        assert await read_file(s, sid, made["envdAccessToken"], "/home/user/kept.txt") == b"through the reboot"
        status, info = await s.call("GET", f"/sandboxes/{sid}")
        assert info["state"] == "running" and "envdUnresponsiveAtPause" not in info
        events = (await s.call("GET", f"/sandboxes/{sid}/events?verify=true"))[1]
        checkpoints = [e for e in events["events"] if e["kind"] == "checkpoint"]
        assert len(checkpoints) == 2 and events["verified"]["ok"] is True  # the memory one, then its files
        assert checkpoints[1]["data"]["parent_id"] == checkpoints[0]["data"]["checkpoint_id"]


@pytest.mark.parametrize("standby", [True, False], ids=["from-its-standby", "from-the-store"])
async def test_a_sandbox_paused_with_memory_reboots_from_its_files(standby: bool) -> None:
    async with serving(pool_size=0, **({} if standby else {"standby_seconds": 0})) as s:
        status, made = await s.call("POST", "/sandboxes", {"templateID": "base", "timeout": 300})
        assert status == 201, made
        sid, token = made["sandboxID"], made["envdAccessToken"]
        await write_file(s, sid, token, "/home/user/kept.txt", b"kept")
        assert (await s.call("POST", f"/sandboxes/{sid}/pause", {}))[0] == 204
        held = s.manager.records[sid].settings.standby
        assert (held is not None) == standby
        before = set(s.runtime.names())
        status, body = await s.call("POST", f"/sandboxes/{sid}/resume", {"timeout": 60, "memory": False})
        assert status == 201, body
        row = s.manager.records[sid]
        assert row.runtime_name not in before and row.settings.standby is None  # a new boot
        assert s.runtime.names() == [row.runtime_name]  # the standby, or the restore the files came out of, is gone
        assert await read_file(s, sid, token, "/home/user/kept.txt") == b"kept"
        assert (await s.call("GET", f"/sandboxes/{sid}"))[1]["state"] == "running"


async def test_a_healthy_pause_is_unmarked_and_resumes() -> None:
    async with serving(pool_size=0) as s:
        status, made = await s.call("POST", "/sandboxes", {"templateID": "base", "timeout": 300})
        assert status == 201, made
        sid = made["sandboxID"]
        assert (await s.call("POST", f"/sandboxes/{sid}/pause", {"requireHealthyGuest": True}))[0] == 204
        status, info = await s.call("GET", f"/sandboxes/{sid}")
        assert info["pauseMode"] == "full" and "envdUnresponsiveAtPause" not in info
        assert (await s.call("POST", f"/v2/sandboxes/{sid}/connect", {"timeout": 60}))[0] == 201
