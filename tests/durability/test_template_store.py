"""A template built on one server is usable by name on another that shares its store: the template snapshot's
label carries its name, tags and state (docs/design/template-builds.md, "Resolution")."""

from __future__ import annotations

import tempfile
import uuid
from typing import Any

from e2b import Sandbox, Template

from tests.durability.conftest import Fleet, sdk_opts


def test_a_template_built_on_one_server_creates_on_another(fleet: Fleet) -> None:
    store = "file://" + tempfile.mkdtemp(prefix="keepstate-shared-store-")
    a, b = fleet.start(store=store), fleet.start(store=store)
    name = f"ks-test-shared-{uuid.uuid4().hex[:8]}"
    t: Any = (Template().from_base_image()
              .run_cmd("echo built on a > /home/user/where")
              .set_envs({"SHARED": "yes"}))
    Template.build(t, f"{name}:v1", cpu_count=1, memory_mb=1024, **sdk_opts(a))
    assert not Template.exists(f"never-{name}", **sdk_opts(b))
    sbx = Sandbox.create(f"{name}:v1", timeout=60, **sdk_opts(b))
    try:
        r = sbx.commands.run('cat /home/user/where; echo "$SHARED"')
        assert r.stdout == "built on a\nyes\n"
    finally:
        sbx.kill()
    assert Template.exists(name, **sdk_opts(b))  # known on b from now on
    # b's history of the new sandbox begins with a link, by ID, to the build session on a.
    import json
    import urllib.request

    req = urllib.request.Request(f"{b.url}/sandboxes/{sbx.sandbox_id}/events", headers={"X-API-KEY": b.key})
    with urllib.request.urlopen(req, timeout=30) as r:
        events = json.loads(r.read())
    first = (events.get("events") if isinstance(events, dict) else events)[0]
    assert first["kind"] == "session.fork.remote", first
