"""A template built with the stock SDK's `Template().from_image(...)` from an image with no Python and no glibc
(Debian's static busybox, pushed to a real registry on loopback), then a sandbox of it: the build's steps ran in
it under gVisor, the image's files and the steps' are there, and the agent (on its own runtime) answers commands
as root and as the image's `user`. A second build of the same image pulls no blob again."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from keepstate.testing import oci_layout
from keepstate.testing.registry import Registry
from tests.sdk.sdkharness import Server, make_key, start_server

from ..sandbox.conftest import gvisor_unavailable

pytestmark = pytest.mark.skipif(gvisor_unavailable() is not None, reason=str(gvisor_unavailable()))


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    home = tempfile.mkdtemp(prefix="keepstate-image-build-")
    srv = start_server(home, pool=0, extra=("--reap-on-exit",))
    srv.key = make_key(home)
    try:
        yield srv
    finally:
        assert srv.proc is not None
        srv.proc.terminate()
        srv.proc.wait(timeout=120)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Registry, str]]:
    with Registry(workdir=tmp_path_factory.mktemp("registry")) as reg:
        lay = oci_layout.busybox_image(tmp_path_factory.mktemp("busybox") / "layout")
        reg.push_layout(lay.dir, "keepstate/busybox:1", tag="latest")
        yield reg, f"{reg.host}/keepstate/busybox:1"


def test_a_template_from_an_image_without_python(server: Server, registry: tuple[Registry, str],
                                                  tmp_path: Path) -> None:
    from e2b import Sandbox, Template

    reg, ref = registry
    opts = {"api_key": server.key, "api_url": server.url}
    t = (Template().from_image(ref)
         .run_cmd("echo built-in-the-image > /built.txt")
         .set_envs({"FROM_IMAGE": "busybox"})
         .run_cmd("touch /home/user/mine", user="user"))
    logs: list[object] = []
    Template.build(t, "busybox-test", cpu_count=1, memory_mb=512, on_build_logs=logs.append, **opts)
    fetched = len(reg.blob_gets())  # the config and the layer, unless this host's blob cache has them already

    sbx = Sandbox.create("busybox-test", timeout=120, api_key=server.key, api_url=server.url,
                         sandbox_url=server.url)
    try:
        assert sbx.commands.run("cat /built.txt").stdout == "built-in-the-image\n"
        assert sbx.commands.run("echo $FROM_IMAGE").stdout.strip() == "busybox"
        # The image's own tools: busybox, no Python, no glibc loader.
        assert "busybox" in sbx.commands.run("readlink /bin/sh").stdout
        assert sbx.commands.run("test -e /usr/bin/python3 || test -e /bin/python3; echo $?").stdout.strip() == "1"
        assert sbx.commands.run("test -e /lib64/ld-linux-x86-64.so.2; echo $?").stdout.strip() == "1"
        assert sbx.commands.run("id -u", user="user").stdout.strip() == "1000"
        assert sbx.commands.run("stat -c %U /home/user/mine").stdout.strip() == "user"
        sbx.files.write("/tmp/from-the-sdk.txt", "hello")
        assert sbx.files.read("/tmp/from-the-sdk.txt") == "hello"
    finally:
        sbx.kill()

    # The same image again (another template name): nothing is downloaded a second time.
    Template.build(Template().from_image(ref).run_cmd("true"), "busybox-test-2", cpu_count=1, memory_mb=512, **opts)
    assert len(reg.blob_gets()) == fetched, reg.access_log()
