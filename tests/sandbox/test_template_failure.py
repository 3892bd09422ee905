"""A template build that fails after it took a layer publishes nothing, and leaves no checkpoint of its own in
the store (docs/design/template-builds.md, "Publish"); a ready command that never succeeds names its timeout.
Real gVisor, in this process, so the test can look at the database and the store."""

from __future__ import annotations

import asyncio
import time

import pytest
import sqlalchemy as sa

from keepstate.db.schema import template_layers

from .conftest import Served, serving


async def layers(served: Served) -> int:
    """How many step-cache layers the server's database holds."""
    async with served.manager.db.read() as conn:
        return int((await conn.execute(sa.select(sa.func.count()).select_from(template_layers))).scalar_one())


@pytest.mark.timeout(300)
async def test_a_ready_command_that_never_succeeds_fails_the_build_and_publishes_nothing() -> None:
    async with serving("gvisor", pool_size=1) as served:
        builds = served.manager.template_resolver.__self__  # type: ignore[union-attr]
        builds.ready_timeout = 3.0
        repo = served.manager.durable.repo
        before = set(await asyncio.to_thread(repo.ref_ids))
        status, info = await served.call("POST", "/v3/templates", {"name": "never-ready", "cpuCount": 1,
                                                                    "memoryMB": 512})
        assert status == 202
        path = f"/templates/{info['templateID']}/builds/{info['buildID']}"
        status, _ = await served.call("POST", "/v2" + path, {
            "fromImage": "e2bdev/base", "force": False, "startCmd": "sleep 600", "readyCmd": "false",
            "steps": [{"type": "RUN", "args": ["echo layer > /tmp/layer"], "force": False}]})
        assert status == 202
        deadline = time.monotonic() + 240
        while (build := (await served.call("GET", path + "/status"))[1])["status"] not in ("ready", "error"):
            assert time.monotonic() < deadline, build
            await asyncio.sleep(0.5)
        assert build["status"] == "error"
        assert build["reason"]["step"] == "finalize"
        assert "ready command 'false' did not succeed within 3 s (the ready timeout)" in build["reason"]["message"]
        messages = [e["message"] for e in build["logEntries"]]
        assert any(m.startswith("layer cached") for m in messages), messages  # it had taken a layer
        # Nothing published, nothing of its own left: no layer, no checkpoint, no build sandbox.
        assert await layers(served) == 0
        assert set(await asyncio.to_thread(repo.ref_ids)) == before
        status, err = await served.call("POST", "/v2/sandboxes", {"templateID": "never-ready", "timeout": 30})
        assert status == 404, err
        assert not [r for r in served.manager.listed()]


@pytest.mark.timeout(300)
async def test_deleting_a_template_deletes_its_snapshot_and_keeps_the_step_cache() -> None:
    async with serving("gvisor", pool_size=1) as served:
        repo = served.manager.durable.repo
        before = set(await asyncio.to_thread(repo.ref_ids))
        status, info = await served.call("POST", "/v3/templates", {"name": "short-lived", "memoryMB": 512})
        path = f"/templates/{info['templateID']}/builds/{info['buildID']}"
        status, _ = await served.call("POST", "/v2" + path, {
            "fromTemplate": "base", "steps": [{"type": "RUN", "args": ["echo x > /tmp/x"], "force": False}]})
        assert status == 202
        deadline = time.monotonic() + 240
        while (build := (await served.call("GET", path + "/status"))[1])["status"] not in ("ready", "error"):
            assert time.monotonic() < deadline, build
            await asyncio.sleep(0.5)
        assert build["status"] == "ready", build
        taken = set(await asyncio.to_thread(repo.ref_ids)) - before
        assert len(taken) == 2  # the step's layer and the template's snapshot
        status, _ = await served.call("DELETE", "/templates/short-lived")
        assert status == 204
        left = set(await asyncio.to_thread(repo.ref_ids)) - before
        assert len(left) == 1 and left < taken  # the layer stays for the step cache
        assert await layers(served) == 1
        status, _ = await served.call("POST", "/v2/sandboxes", {"templateID": "short-lived", "timeout": 30})
        assert status == 404
