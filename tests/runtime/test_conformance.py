"""One conformance suite for the Runtime seam, run against every runtime: the fake (always) and gVisor (as root with
runsc and a built `base` template). What the sandbox package relies on is what is checked here."""

from __future__ import annotations

import secrets
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from keepstate.ports import AGENT_PORT
from keepstate.runtime.base import Handle, Limits, Runtime, RuntimeFailure, SandboxSpec, TemplateRoot
from keepstate.testing import FakeRuntime, leftovers

from ..sandbox.conftest import gvisor_unavailable


@dataclass
class Subject:
    runtime: Runtime
    root: TemplateRoot
    claimed: list[int]

    def slot(self) -> int:
        for n in range(1, self.runtime.slots.max_slots):
            if self.runtime.slots.claim(n):
                self.claimed.append(n)
                return n
        raise AssertionError("no free slot")

    def spec(self) -> SandboxSpec:
        return SandboxSpec(name="ks-conf-" + secrets.token_hex(4), template=self.root, limits=Limits(1, 256))


@pytest.fixture(params=["fake", "gvisor"])
def subject(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Subject]:
    if request.param == "fake":
        runtime: Runtime = FakeRuntime()
        root = TemplateRoot("base", "sha256:fake-base", tmp_path)
    else:
        why = gvisor_unavailable()
        if why:
            pytest.skip(why)
        from keepstate.runtime.gvisor import GVisorRuntime
        from keepstate.template import builder

        built = builder.latest("base")
        assert built is not None
        runtime = GVisorRuntime(tmp_path / "sandboxes")
        runtime.prepare()
        root = TemplateRoot(built.name, built.digest, built.rootfs)
    s = Subject(runtime, root, [])
    yield s
    for name, _ in runtime.statuses().items():
        if name.startswith("ks-conf-"):
            runtime.destroy(Handle(name, -1))
    for n in s.claimed:
        runtime.slots.release(n)


def health(handle: Handle, timeout: float = 2.0) -> int:
    assert handle.endpoint is not None
    url = f"http://{handle.endpoint.address}:{handle.endpoint.agent_port}/health"
    with urllib.request.urlopen(url, timeout=timeout) as r:  # closed on exit: no connection outlives the call
        return int(r.status)


def wait_agent(handle: Handle, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if health(handle) < 300:
                return
        except (OSError, urllib.error.URLError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"agent of {handle.name} did not answer")
        time.sleep(0.05)


# The host's side in which the sandbox's side may still be established: ESTABLISHED, SYN_SENT, SYN_RECV, FIN_WAIT1
# (our FIN not yet acknowledged). In CLOSE_WAIT, LAST_ACK and CLOSING the sandbox has sent its FIN: closed there.
OPEN_STATES = {"01", "02", "03", "04"}


def _hex(address: str, port: int) -> str:
    return "".join(f"{int(b):02X}" for b in reversed(address.split("."))) + f":{port:04X}"


def wait_closed(handle: Handle, timeout: float = 10.0) -> None:
    """Until no TCP connection to the agent is open on the host's side: a checkpoint needs none (gVisor's restored
    agent wedges on one). A closed connection whose FIN the sandbox has acknowledged is FIN_WAIT2 or TIME_WAIT."""
    assert handle.endpoint is not None
    peer = _hex(handle.endpoint.address, handle.endpoint.agent_port)
    deadline = time.monotonic() + timeout
    while True:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
        open_now = [ln for ln in lines if peer in ln.split()[1:3] and ln.split()[3] in OPEN_STATES]
        if not open_now:
            return
        assert time.monotonic() < deadline, f"connections to {handle.name} still open: {open_now}"
        time.sleep(0.01)  # polling interval


def test_create_answers_on_the_agent_port_and_is_listed(subject: Subject) -> None:
    rt = subject.runtime
    spec, slot = subject.spec(), subject.slot()
    handle = rt.create(spec, slot)
    assert handle.name == spec.name and handle.slot == slot and handle.endpoint is not None
    assert handle.endpoint.agent_port == AGENT_PORT
    wait_agent(handle)
    assert rt.is_alive(handle) and rt.state(spec.name) == "running"
    assert isinstance(rt.release, str) and rt.release  # written into every manifest
    assert rt.statuses().get(spec.name) == "running"
    stats = rt.cgroup_stats(handle)
    assert {"cpu_ns", "mem_used", "mem_limit"} <= set(stats) and stats["mem_limit"] <= 256 << 20
    rt.destroy(handle)
    assert rt.state(spec.name) == "gone" and not rt.is_alive(handle) and spec.name not in rt.statuses()
    assert rt.cgroup_stats(handle) == {}
    rt.destroy(handle)  # idempotent


def test_freeze_stops_answering_until_thawed(subject: Subject) -> None:
    rt = subject.runtime
    handle = rt.create(subject.spec(), subject.slot())
    wait_agent(handle)
    rt.freeze(handle)
    assert rt.state(handle.name) == "paused" and rt.is_alive(handle)
    with pytest.raises((OSError, urllib.error.URLError, socket.timeout)):
        health(handle, timeout=0.5)
    rt.thaw(handle)
    assert rt.state(handle.name) == "running"
    wait_agent(handle, timeout=20)
    rt.destroy(handle)


def test_idle_freeze_stops_answering_until_idle_thaw(subject: Subject) -> None:
    """An idle freeze (docs/design/idle.md): nothing answers, yet the instance is running to every state reader
    (reading it must not hang on it), and a thaw runs it on; destroying a frozen one works."""
    rt = subject.runtime
    handle = rt.create(subject.spec(), subject.slot())
    wait_agent(handle)
    wait_closed(handle)
    rt.idle_freeze(handle)
    assert rt.idle_frozen(handle)
    assert rt.state(handle.name) == "running" and rt.is_alive(handle)
    assert rt.statuses().get(handle.name) == "running"
    with pytest.raises((OSError, urllib.error.URLError, socket.timeout)):
        health(handle, timeout=0.5)
    rt.idle_thaw(handle)
    rt.idle_thaw(handle)  # idempotent
    assert not rt.idle_frozen(handle)
    wait_agent(handle, timeout=20)
    wait_closed(handle)
    rt.idle_freeze(handle)
    rt.destroy(handle)
    assert rt.state(handle.name) == "gone" and not rt.is_alive(handle)
    rt.idle_thaw(handle)  # gone: nothing to do


def _write_file(handle: Handle, path: str, data: bytes) -> None:
    """Through the agent's /files (a new sandbox's agent has no token before its /init), as E2B's SDK writes."""
    assert handle.endpoint is not None
    boundary = "ks" + secrets.token_hex(8)
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    url = f"http://{handle.endpoint.address}:{handle.endpoint.agent_port}/files?path={path}&username=root"
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


def test_export_files_holds_what_was_written_without_asking_the_agent(subject: Subject, tmp_path: Path) -> None:
    import tarfile

    rt = subject.runtime
    handle = rt.create(subject.spec(), subject.slot())
    wait_agent(handle)
    _write_file(handle, "/root/exported.txt", b"kept by a reboot")
    wait_closed(handle)
    size = rt.export_files(handle, tmp_path / "files.tar")
    with tarfile.open(tmp_path / "files.tar") as tar:
        member = tar.getmember("root/exported.txt")
        assert tar.extractfile(member).read() == b"kept by a reboot"  # type: ignore[union-attr]
    assert size == (tmp_path / "files.tar").stat().st_size
    assert rt.state(handle.name) == "running"
    rt.freeze(handle)
    with pytest.raises(RuntimeFailure):
        rt.export_files(handle, tmp_path / "frozen.tar")  # runsc exec needs a running sentry
    rt.destroy(handle)


def test_checkpoint_of_an_idle_frozen_instance_runs_it_on(subject: Subject, tmp_path: Path) -> None:
    rt = subject.runtime
    handle = rt.create(subject.spec(), subject.slot())
    wait_agent(handle)
    wait_closed(handle)
    rt.idle_freeze(handle)
    rt.checkpoint(handle, tmp_path / "image", leave_running=True)
    assert not rt.idle_frozen(handle) and rt.state(handle.name) == "running"
    wait_agent(handle, timeout=20)
    rt.destroy(handle)


def test_checkpoint_then_restore_into_another_slot(subject: Subject, tmp_path: Path) -> None:
    rt = subject.runtime
    handle = rt.create(subject.spec(), subject.slot())
    wait_agent(handle)
    wait_closed(handle)
    image = tmp_path / "image"
    rt.checkpoint(handle, image, leave_running=True)
    assert rt.state(handle.name) == "running" and any(image.iterdir())
    rt.freeze(handle)
    frozen_image = tmp_path / "frozen"
    rt.checkpoint(handle, frozen_image, leave_running=True)
    assert rt.state(handle.name) == "paused"  # a frozen sandbox stays frozen
    spec2, slot2 = subject.spec(), subject.slot()
    restored = rt.restore(spec2, frozen_image, slot2)
    assert restored.slot == slot2 and restored.endpoint is not None
    assert restored.endpoint.address != handle.endpoint.address  # type: ignore[union-attr]
    wait_agent(restored, timeout=30)
    assert rt.state(spec2.name) == "running"
    rt.destroy(restored)
    rt.destroy(handle)


def test_restore_of_a_missing_image_fails_clearly(subject: Subject, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RuntimeFailure):
        subject.runtime.restore(subject.spec(), empty, subject.slot())


def test_slots_are_claimed_once_and_record_their_owner(subject: Subject, tmp_path: Path) -> None:
    slots = subject.runtime.slots
    n = subject.slot()
    assert not slots.claim(n)
    home = tmp_path / "home"  # not made yet: a data directory that is gone
    slots.record_owner(n, str(home), "ks-conf-owner")
    assert slots.owner(n) == "ks-conf-owner"
    assert (n, "ks-conf-owner") in slots.orphaned()  # its data directory is gone: nobody will adopt it
    home.mkdir()  # a data directory that exists is alive, database file or not
    assert (n, "ks-conf-owner") not in slots.orphaned()
    slots.release(n)
    assert slots.owner(n) is None and slots.claim(n)


def test_inventory_lists_an_instance_until_it_is_destroyed_and_its_slot_released(subject: Subject,
                                                                                 tmp_path: Path) -> None:
    rt = subject.runtime
    # tmp_path exists: a live data directory, so no server on this host takes its instances for orphans
    spec, slot = subject.spec(), subject.slot()
    rt.slots.record_owner(slot, str(tmp_path), spec.name)
    handle = rt.create(spec, slot)
    wait_agent(handle)
    mine = [lo for lo in leftovers(tmp_path, rt) if lo.name == spec.name]
    assert {"container", "slot"} <= {lo.kind for lo in mine}
    assert rt.remains(handle) and all(lo.kind != "slot" for lo in rt.remains(handle))
    rt.destroy(handle)
    assert rt.remains(handle) == []
    assert [lo.kind for lo in leftovers(tmp_path, rt) if lo.name == spec.name] == ["slot"]  # the caller's to release
    rt.slots.release(slot)
    assert leftovers(tmp_path, rt) == []
