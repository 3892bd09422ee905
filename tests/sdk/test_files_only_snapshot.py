"""A filesystem-only snapshot with the stock SDK (e2b 2.63 `create_snapshot(mode="filesystem")`; issue 28), on
gVisor: the source runs on, its processes continuing; three sandboxes made from the snapshot each have its files,
boot afresh (none of its processes), and diverge."""

from __future__ import annotations

import inspect

import pytest
from e2b import Sandbox

pytestmark = pytest.mark.skipif("mode" not in inspect.signature(Sandbox.create_snapshot).parameters,
                                reason="this SDK release has no snapshot modes (e2b < 2.55)")


def test_a_filesystem_only_snapshot_makes_fresh_boots_with_its_files(new_sandbox) -> None:
    sbx = new_sandbox(timeout=300)
    sbx.files.write("/home/user/snap.txt", "files only")
    marker = sbx.commands.run("sleep 1234567 >/dev/null 2>&1 &", background=False)
    assert marker.exit_code == 0
    snap = sbx.create_snapshot(mode="filesystem")
    children = [Sandbox.create(template=snap.snapshot_id, timeout=120) for _ in range(3)]
    try:
        for i, child in enumerate(children):
            assert child.files.read("/home/user/snap.txt") == "files only"
            assert "sleep 1234567" not in child.commands.run("ps -eo args").stdout  # a new boot: no process of it
            child.files.write("/home/user/mine.txt", str(i))
        assert [c.files.read("/home/user/mine.txt") for c in children] == ["0", "1", "2"]
        assert "sleep 1234567" in sbx.commands.run("ps -eo args").stdout  # the source runs on, processes and all
    finally:
        for child in children:
            child.kill()
        Sandbox.delete_snapshot(snap.snapshot_id)
