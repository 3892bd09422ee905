"""Guest-health-aware pauses (E2B SDK 2.63; issue 28): a pause asks the sandbox's agent first. One that does not
answer is recorded on the pause (`envdUnresponsiveAtPause`), and a resume with memory is then refused with 409
`sandbox_snapshot_guest_agent_unresponsive` (restoring that memory would bring the hung agent back); with
`requireHealthyGuest` the pause is refused with 503 and the sandbox runs on. A healthy pause is unmarked."""

from __future__ import annotations

import pytest

from keepstate.sandbox import agent_client
from keepstate.sandbox.instances import handle_of

from .conftest import serving


async def test_an_unresponsive_agent_is_recorded_on_the_pause_or_refuses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_client, "HEALTH_TIMEOUT", 0.3)
    async with serving(pool_size=0) as s:
        status, made = await s.call("POST", "/sandboxes", {"templateID": "base", "timeout": 300})
        assert status == 201, made
        sid = made["sandboxID"]
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


async def test_a_healthy_pause_is_unmarked_and_resumes() -> None:
    async with serving(pool_size=0) as s:
        status, made = await s.call("POST", "/sandboxes", {"templateID": "base", "timeout": 300})
        assert status == 201, made
        sid = made["sandboxID"]
        assert (await s.call("POST", f"/sandboxes/{sid}/pause", {"requireHealthyGuest": True}))[0] == 204
        status, info = await s.call("GET", f"/sandboxes/{sid}")
        assert info["pauseMode"] == "full" and "envdUnresponsiveAtPause" not in info
        assert (await s.call("POST", f"/v2/sandboxes/{sid}/connect", {"timeout": 60}))[0] == 201
