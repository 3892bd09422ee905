"""The agent runtime (docs/design/agent-runtime.md): built once on the host, content-addressed, and enough for
the agent on an image with no Python and no glibc, or with site-packages its user has broken.

The gVisor cases run real sandboxes through the stock SDK against a server of this checkout, with a template
whose root is Debian's busybox-static, laid out as the template builder lays out its builds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from keepstate.mountpoints import AGENT_PACKAGE, AGENT_RUNTIME, TEMPLATE_VIEW, VOLUME_SLOTS, VOLUMES_DIR
from keepstate.runtime import agent_runtime as agent_rt
from keepstate.runtime.base import Limits, RuntimeFailure, SandboxSpec, TemplateRoot
from keepstate.runtime.gvisor import RUNTIME_FILE, GVisorRuntime, have_runsc

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "keepstate"
BUSYBOX = Path("/bin/busybox") if Path("/bin/busybox").exists() else Path("/usr/bin/busybox")
TEMPLATE = "test-agentrt-busybox"
SHARED_TEMPLATES = Path("/var/lib/keepstate/templates")  # sdkharness.TEMPLATE_CACHE: the built `base`

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="builds into the shared cache and chroots: root only")
needs_gvisor = pytest.mark.skipif(not have_runsc(), reason="needs runsc and root")


@pytest.fixture(scope="module")
def runtime() -> agent_rt.AgentRuntime:
    """This host's runtime (scripts/test.sh has `keepstate template build` make it before the network goes)."""
    if os.geteuid() != 0:
        pytest.skip("the runtime cache is root's")
    return agent_rt.ensure()


# -- the runtime directory -----------------------------------------------------------------------------------
@needs_root
def test_runtime_is_content_addressed_and_rebuilds_to_the_same_digest(runtime: agent_rt.AgentRuntime,
                                                                      tmp_path: Path) -> None:
    assert runtime.path.name == runtime.digest == agent_rt.tree_digest(runtime.path)
    assert agent_rt.find(runtime.digest) == runtime
    assert agent_rt.find("0" * 64) is None and agent_rt.find("../etc") is None
    info = json.loads((runtime.path / "runtime.json").read_text())
    assert info["format"] == agent_rt.FORMAT and info["input_key"] == agent_rt.input_key(agent_rt.default_sources())
    assert {"ld-linux-x86-64.so.2", "libc.so.6", "libm.so.6", "libz.so.1", "libssl.so.3", "libffi.so.8",
            "libnss_files.so.2"} <= set(info["libraries"])
    # Nothing in it points outside it.
    for p in runtime.path.rglob("*"):
        assert not p.is_symlink() or Path(p.parent, os.readlink(p)).resolve().is_relative_to(runtime.path), p

    # Deterministic: two builds from the same host give the same tree. (Not necessarily the tree of `runtime`,
    # made earlier: the host's own stdlib __pycache__, which the runtime copies, grows as python3.11 runs here.
    # The host keeps the runtime it made, found by its inputs, and checkpoints name theirs by digest.)
    again, twice = tmp_path / "rt", tmp_path / "rt2"
    for dest in (again, twice):
        agent_rt.build(dest, agent_rt.default_sources(), agent_rt.cache_dir() / "wheels", download=False)
    assert agent_rt.tree_digest(again) == agent_rt.tree_digest(twice)
    before = agent_rt.tree_digest(again)
    (again / "site" / "uvicorn" / "__init__.py").write_text("raise ImportError('changed')\n")
    assert agent_rt.tree_digest(again) != before


@needs_root
def test_agent_starts_on_the_runtime_alone_in_an_empty_root(runtime: agent_rt.AgentRuntime, tmp_path: Path) -> None:
    """chroot into a root holding only the runtime and the package (no Python, no glibc, no loader of its own):
    python3 runs through the runtime's loader, reads users with the runtime's glibc, and boot.py starts the
    agent's command line."""
    root = tmp_path / "root"
    for d in (AGENT_RUNTIME, f"{AGENT_PACKAGE}/keepstate", "/etc", "/tmp"):
        (root / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\nuser:x:1000:\n")
    probe = ("import sys, pwd, os; sys.path[:0] = ['/opt/keepstate/lib', '/opt/keepstate/rt/site'];"
             "import keepstate.agent.app, uvicorn, uvloop, httptools;"
             "print(sys.prefix, pwd.getpwnam('user').pw_uid, os.getgrouplist('user', 1000))")
    boot = agent_rt.agent_argv()[4:]  # the sandbox's command without tini
    script = (f"mount --make-rprivate / && mount --bind -o ro {runtime.path} {root}{AGENT_RUNTIME} && "
              f"mount --bind -o ro {PACKAGE} {root}{AGENT_PACKAGE}/keepstate && "
              f"chroot {root} \"$@\" && chroot {root} {' '.join(boot)} --help")
    inner = agent_rt.loader_argv(AGENT_RUNTIME, "bin/python3", "-I", "-S", "-c", probe)
    out = subprocess.run(["unshare", "-m", "--", "sh", "-c", script, "sh", *inner], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    first, *rest = out.stdout.splitlines()
    assert first == f"{AGENT_RUNTIME} 1000 [1000]"
    assert "python3 -m keepstate.agent" in "\n".join(rest)  # the agent's --help, printed by boot.py's agent


def test_a_restore_mounts_the_runtime_its_image_names(tmp_path: Path) -> None:
    """The image records its runtime; a restore onto a host without that one is refused, naming both."""
    rt = GVisorRuntime(tmp_path / "state", runsc_root=tmp_path / "runsc")
    here = agent_rt.AgentRuntime("a" * 64, tmp_path / "rt")
    rt._agent_runtime = here
    spec = SandboxSpec("ks-t", TemplateRoot("base", "d", tmp_path / "root"), Limits())
    image = tmp_path / "image"
    image.mkdir()
    assert rt._runtime_for(spec, image) == here  # an image from before the runtime was recorded
    (image / RUNTIME_FILE).write_text("a" * 64 + "\n")
    assert rt._runtime_for(spec, image) == here
    (image / RUNTIME_FILE).write_text("b" * 64 + "\n")
    with pytest.raises(RuntimeFailure, match=r"agent runtime bbbbbbbbbbbbbbbb, which this host does not have"):
        rt._runtime_for(spec, image)


def test_the_sdks_bash_becomes_sh_only_where_there_is_no_bash(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from keepstate.agent import process

    sh = tmp_path / "sh"
    sh.write_text("")
    monkeypatch.setattr(process, "FALLBACK_SHELL", str(sh))
    monkeypatch.setattr(process, "SDK_SHELL", str(tmp_path / "bash"))
    assert process.shell_fallback([str(tmp_path / "bash"), "-l", "-c", "echo hi"]) == [str(sh), "-l", "-c", "echo hi"]
    assert process.shell_fallback(["/usr/bin/env", "x"]) == ["/usr/bin/env", "x"]
    (tmp_path / "bash").write_text("")
    assert process.shell_fallback([str(tmp_path / "bash"), "-c", "x"]) == [str(tmp_path / "bash"), "-c", "x"]


# -- in real sandboxes ---------------------------------------------------------------------------------------
def _busybox_root(root: Path) -> None:
    """Debian's busybox-static and its applet links, root and user, /tmp: no Python, no glibc, no loader."""
    (root / "bin").mkdir(parents=True)
    shutil.copy(BUSYBOX, root / "bin/busybox")
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout.split()
    for name in applets:
        if name != "busybox":
            (root / "bin" / name).symlink_to("busybox")
    etc = root / "etc"
    (etc / "keepstate").mkdir(parents=True)
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n")
    (etc / "group").write_text("root:x:0:\nuser:x:1000:\n")
    (etc / "hosts").write_text("127.0.0.1\tlocalhost\n")
    (etc / "resolv.conf").write_text("options timeout:1 attempts:1\n")
    (etc / "keepstate/template.json").write_text(json.dumps(
        {"name": TEMPLATE, "user": "user", "workdir": "/home/user", "env": {}, "services": []}))
    for d in ("tmp", "root", "home/user", "run", "var/log", "proc", "dev", "sys", f"{AGENT_PACKAGE}/keepstate",
              AGENT_RUNTIME, TEMPLATE_VIEW, *(f"{VOLUMES_DIR}/{i}" for i in range(VOLUME_SLOTS))):
        (root / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o1777)
    os.chown(root / "home/user", 1000, 1000)


def _register_template(cache: Path, defs: Path) -> None:
    """A build of TEMPLATE in `cache`, as builder.py lays builds out, with its definition in `defs`."""
    from keepstate.rootfs import rootfs_digest
    from keepstate.template.definition import BUILTIN_DEFINITIONS, definition_digest, load

    defs.mkdir()
    shutil.copy(BUILTIN_DEFINITIONS / "base.toml", defs / "base.toml")
    (defs / f"{TEMPLATE}.toml").write_text(
        f'name = "{TEMPLATE}"\ndescription = "tests: busybox-static only (no Python, no glibc)"\n'
        '[root]\nsuite = "bookworm"\nvariant = "minbase"\n'
        '[defaults]\nuser = "user"\nworkdir = "/home/user"\ncpu = 1\nmemory_mb = 256\nenv = {}\n')
    os.environ["KEEPSTATE_TEMPLATES"] = str(defs)
    ddigest = definition_digest(load(TEMPLATE), None)
    build = cache / TEMPLATE / ddigest
    _busybox_root(build / "rootfs")
    (build / "build.json").write_text(json.dumps({
        "name": TEMPLATE, "definition_digest": ddigest, "digest": rootfs_digest(build / "rootfs"),
        "built_at": time.time(), "parent": None, "packages": []}))
    (cache / TEMPLATE / "current").symlink_to(ddigest)
    (cache / "base").symlink_to(SHARED_TEMPLATES / "base")


@pytest.fixture(scope="module")
def server(runtime: agent_rt.AgentRuntime) -> Iterator[None]:
    """A server of this checkout (PYTHONPATH), its templates `base` (the shared build) and the busybox one."""
    if not have_runsc():
        pytest.skip("needs runsc and root")
    if not (SHARED_TEMPLATES / "base" / "current").exists():
        pytest.skip("needs the built base template (keepstate template build base)")
    from sdkharness import make_key, start_server

    work = Path(tempfile.mkdtemp(prefix="keepstate-agentrt-"))
    saved = dict(os.environ)
    try:
        _register_template(work / "templates", work / "defs")
        os.environ["PYTHONPATH"] = str(REPO)
        os.environ["KEEPSTATE_AGENT_RUNTIME_CACHE"] = str(agent_rt.cache_dir())
        (work / "home").mkdir()
        srv = start_server(str(work / "home"), pool=0, extra=("--warm", TEMPLATE, "--reap-on-exit"),
                           template_cache=str(work / "templates"))
        srv.key = make_key(srv.home)
        os.environ.update({"E2B_API_URL": srv.url, "E2B_SANDBOX_URL": srv.url, "E2B_API_KEY": srv.key,
                           "NO_PROXY": "127.0.0.1,localhost"})
        os.environ.pop("E2B_DEBUG", None)
        try:
            yield
        finally:
            assert srv.proc is not None
            srv.proc.terminate()
            srv.proc.wait(timeout=60)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(work, ignore_errors=True)


@needs_gvisor
def test_agent_serves_on_an_image_with_no_python_and_no_glibc(server: None) -> None:
    from e2b import Sandbox

    first = Sandbox.create(template=TEMPLATE, timeout=120)
    try:
        assert first.commands.run("test ! -e /usr/bin/python3 && test ! -e /lib64 && echo hi").stdout == "hi\n"
        assert first.commands.run("id -un; id -u; pwd").stdout.split() == ["user", "1000", "/home/user"]
        assert first.commands.run("id -u", user="root").stdout == "0\n"
        first.files.write("notes/a.txt", "written through the agent\n")
        assert first.files.read("/home/user/notes/a.txt") == "written through the agent\n"
        assert first.files.get_info("notes/a.txt").owner == "user"
        assert first.commands.run("cat notes/a.txt").stdout == "written through the agent\n"
        pid1 = first.files.read("/proc/1/cmdline").split("\0")[:-1]
        assert pid1 == agent_rt.agent_argv()  # tini and the agent, both from the runtime
        # The second sandbox of the template is restored from the first's boot image: the image names its
        # runtime, and the restore mounts it again.
        second = Sandbox.create(template=TEMPLATE, timeout=120)
        try:
            assert second.commands.run("echo again").stdout == "again\n"
            boot_id = "/proc/sys/kernel/random/boot_id"  # one image's restores share its kernel's (boot-images.md)
            assert second.files.read(boot_id) == first.files.read(boot_id)
            assert not second.files.exists("/home/user/notes/a.txt")
        finally:
            second.kill()
    finally:
        first.kill()


BROKEN = "raise ImportError('broken by a pip install')\n"


@needs_gvisor
def test_broken_site_packages_of_the_image_do_not_reach_the_agent(server: None) -> None:
    """A user's pip install that breaks uvicorn and protobuf (and a .pth that kills every python at start, in
    the image's site-packages and the user's) breaks the image's python, not an agent started on them."""
    from e2b import CommandExitException, Sandbox

    from sdkharness import wait_until

    sbx = Sandbox.create(template="base", timeout=180)
    try:
        for site in ("/usr/local/lib/python3.11/dist-packages", "/home/user/.local/lib/python3.11/site-packages"):
            for pkg in ("uvicorn", "protobuf", "uvloop", "google/protobuf"):
                sbx.files.write(f"{site}/{pkg}/__init__.py", BROKEN, user="root")
            sbx.files.write(f"{site}/zz-broken.pth", "import os; os._exit(3)\n", user="root")
        with pytest.raises(CommandExitException) as broken:
            sbx.commands.run("python3 -c 'import uvicorn'")
        assert broken.value.exit_code == 3  # the image's python no longer even starts
        boot = " ".join(agent_rt.agent_argv()[4:])  # the agent's own start, as PID 1 runs it (without tini)
        sbx.commands.run(f"KEEPSTATE_SUDO_SOCKET=/tmp/sudo2.sock {boot} --port 49990 >/tmp/agent2.log 2>&1",
                         user="root", background=True)
        health = "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:49990/health || true"
        wait_until(lambda: sbx.commands.run(health, user="root").stdout.strip() in ("200", "204"), 60,
                   lambda: "the second agent: " + sbx.files.read("/tmp/agent2.log", user="root"))
        # a Connect call: protobuf messages in and out, by the runtime's own protobuf
        stat = sbx.commands.run("curl -s -X POST -H 'Content-Type: application/json' "
                                "-H 'Connect-Protocol-Version: 1' -d '{\"path\": \"/etc/hostname\"}' "
                                "http://127.0.0.1:49990/filesystem.Filesystem/Stat", user="root").stdout
        assert json.loads(stat)["entry"]["path"] == "/etc/hostname", stat
        assert sbx.commands.run("echo still").stdout == "still\n"  # and the sandbox's own agent serves on
    finally:
        sbx.kill()
