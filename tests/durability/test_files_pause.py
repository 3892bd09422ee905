"""Filesystem-only pause across a server's kill -9, and with a corrupt store (docs/design/sandbox-disk.md)."""

from __future__ import annotations

import json

import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException

from tests.sdk.sdkharness import start_marker, survived

from .conftest import Fleet, sdk_opts, store_path
from .test_crash import history, ks


def test_sigkill_between_a_filesystem_pause_and_its_resume(fleet: Fleet) -> None:
    srv = fleet.start()
    opts = sdk_opts(srv)
    sbx = Sandbox.create(timeout=300, metadata={"kept": "yes"}, envs={"MINE": "mine"}, **opts)
    sbx.files.write("/home/user/work/result.json", '{"done": true}')
    before = start_marker(sbx)
    sbx.pause(mode="filesystem")
    port = int(srv.url.rsplit(":", 1)[1])
    fleet.sigkill(srv)

    srv2 = fleet.start(home=srv.home, port=port)
    opts2 = sdk_opts(srv2)
    assert Sandbox.get_info(sbx.sandbox_id, **opts2).state.value == "paused"
    again = Sandbox.connect(sbx.sandbox_id, **opts2)
    assert again.files.read("/home/user/work/result.json") == '{"done": true}'
    assert not survived(again, before)
    assert again.commands.run("echo $MINE").stdout.strip() == "mine"  # the create's environment, again
    assert Sandbox.get_info(sbx.sandbox_id, **opts2).metadata == {"kept": "yes"}
    pause = [e for e in history(srv2, sbx.sandbox_id) if e["kind"] == "sandbox.pause"]
    assert pause and pause[-1]["data"]["memory"] is False
    again.kill()


def test_a_corrupt_files_checkpoint_refuses_to_resume_naming_it(fleet: Fleet) -> None:
    srv = fleet.start()
    opts = sdk_opts(srv)
    sbx = Sandbox.create(timeout=300, **opts)
    sbx.commands.run("head -c 2000000 /dev/urandom > /home/user/blob")
    sbx.pause(mode="filesystem")
    ls = json.loads(ks(srv, "checkpoint", "ls", "--json").stdout)
    checkpoint_id = [c["checkpoint_id"] for c in ls if c["session_id"] == sbx.sandbox_id][-1]
    packs = sorted(p for p in store_path(srv).rglob("*") if p.is_file() and "pack" in str(p))
    victim = max(packs, key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))

    with pytest.raises(SandboxException) as err:
        Sandbox.connect(sbx.sandbox_id, **opts)
    assert checkpoint_id in str(err.value) and ("pack" in str(err.value) or "chunk" in str(err.value))
    assert Sandbox.get_info(sbx.sandbox_id, **opts).state.value == "paused"  # nothing half-resumed
    assert ks(srv, "store", "verify").returncode != 0
