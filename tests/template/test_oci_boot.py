"""An image pulled from a registry boots as a sandbox under gVisor: the base template's root, pushed as a one-layer
image to a loopback registry, pulled back by keepstate.template.oci into a template build, started by the real
runtime, its agent answering. (Images without our Python need the agent's own runtime: another module.)"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from keepstate.runtime.base import Handle, Limits, SandboxSpec, TemplateRoot
from keepstate.template import builder, oci
from keepstate.testing import oci_layout
from keepstate.testing.registry import Registry

from ..runtime.test_conformance import wait_agent
from ..sandbox.conftest import gvisor_unavailable


@pytest.fixture
def base_root() -> Iterator[Path]:
    why = gvisor_unavailable()
    if why:
        pytest.skip(why)
    built = builder.latest("base")
    assert built is not None
    yield built.rootfs


@pytest.mark.skipif(not os.environ.get("KEEPSTATE_SLOW_TESTS"),
                    reason="pushes and pulls the 879 MiB base root (about 5 minutes here): run with "
                           "KEEPSTATE_SLOW_TESTS=1; make test covers an image build and boot with the small busybox "
                           "image instead (tests/template/test_image_build.py)")
def test_base_pushed_as_image_boots(base_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from keepstate.runtime.gvisor import GVisorRuntime

    lay = oci_layout.rootfs_image(base_root, tmp_path / "layout", {
        "User": "user", "WorkingDir": "/home/user", "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "FROM_IMAGE=1"]})
    monkeypatch.setenv("KEEPSTATE_TEMPLATE_CACHE", str(tmp_path / "templates"))
    with Registry() as reg:
        reg.push_layout(lay.dir, "keepstate/base:test")
        built = oci.pull_template("base-image", f"{reg.host}/keepstate/base:test", progress=lambda _: None)
    assert (built.defaults.user, built.defaults.env["FROM_IMAGE"]) == ("user", "1")
    assert (built.rootfs / "opt/keepstate/site").is_dir()  # the image's own files are kept as they were
    runtime = GVisorRuntime(tmp_path / "sandboxes")
    runtime.prepare()
    slot = next(n for n in range(1, runtime.slots.max_slots) if runtime.slots.claim(n))
    spec = SandboxSpec(name="ks-oci-" + secrets.token_hex(4),
                       template=TemplateRoot(built.name, built.digest, built.rootfs), limits=Limits(1, 256))
    handle = None
    try:
        handle = runtime.create(spec, slot)
        wait_agent(handle)
        assert runtime.state(spec.name) == "running"
    finally:
        runtime.destroy(handle or Handle(spec.name, slot))
        runtime.slots.release(slot)
    assert os.path.isdir(built.rootfs)
