"""Build template root filesystems, cache them by definition digest, rebuild on change.

Layout under $KEEPSTATE_HOME/templates/<name>/:
    <definition-digest>/rootfs/     the read-only root every sandbox of this build shares
    <definition-digest>/build.json  name, definition digest, rootfs digest, packages, time
    current -> <definition-digest>
A build happens in a temporary folder and is renamed into place only when complete, so an
interrupted build never leaves a usable-looking template behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from keepstate.config import home
from keepstate.errors import KeepStateError, Unavailable
from keepstate.mountpoints import AGENT_RUNTIME, TEMPLATE_VIEW, VOLUME_SLOTS, VOLUMES_DIR
from keepstate.rootfs import agent_requirements, rootfs_digest, sandbox_wheel_args

from .definition import Defaults, Definition, definition_digest, load

Progress = Callable[[str], None]

HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def stderr_progress(msg: str) -> None:
    print(f"keepstate: {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Built:
    name: str
    definition_digest: str
    digest: str
    rootfs: Path
    defaults: Defaults
    built_at: float

    @property
    def template_id(self) -> str:
        return self.name


class BuildError(KeepStateError):
    status = 500


def templates_dir() -> Path:
    """Built templates; shareable between data directories (tests point theirs at one cache)."""
    return Path(os.environ.get("KEEPSTATE_TEMPLATE_CACHE", home() / "templates"))


def debian_mirror() -> str:
    """The first bookworm mirror in this machine's apt sources; no host name is hard-coded."""
    for f in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        uri = None
        for line in f.read_text().splitlines():
            if line.startswith("URIs:"):
                uri = line.split()[1]
            elif line.startswith("Suites:") and "bookworm" in line.split()[1:] and uri:
                return uri
    legacy = Path("/etc/apt/sources.list")
    if legacy.exists():
        for line in legacy.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == "bookworm":
                return parts[1]
    raise BuildError("no Debian bookworm mirror in /etc/apt/sources*; add one, then build again")


def _sh(cmd: list[str], what: str, env: dict[str, str] | None = None, timeout: float = 1800) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-1500:]
        raise BuildError(f"{what} failed ({proc.returncode}): {tail}")
    return proc.stdout


def _chroot(rootfs: Path, script: str, what: str) -> None:
    """Run a shell script in the root filesystem, with /proc and /dev, in a private mount namespace."""
    inner = (
        f"mount --make-rprivate / && mount -t proc proc {rootfs}/proc && "
        f"mount --rbind /dev {rootfs}/dev && exec chroot {rootfs} /bin/sh -ec \"$0\""
    )
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "DEBIAN_FRONTEND": "noninteractive", "HOME": "/root", "LANG": "C.UTF-8"}
    _sh(["unshare", "-m", "--", "sh", "-c", inner, script], what, env=env)


def _pip_target(reqs: list[str], target: Path, what: str) -> None:
    """Install binary wheels for the sandbox's Python into `target`."""
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-warn-script-location",
           "--disable-pip-version-check", "--target", str(target), *sandbox_wheel_args(), "--upgrade", *reqs]
    _sh(cmd, what)


def _npm_install(rootfs: Path, packages: list[str]) -> None:
    """`npm install -g` in the root, trusting the host's CA bundle.

    The host's bundle may hold the CA of a TLS-intercepting proxy that the root's own Debian bundle
    lacks. Neither that bundle nor npm's download cache is left in the root.
    """
    scratch = rootfs / "tmp" / "keepstate-npm"
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        opts = ["--no-fund", "--no-audit", "--cache", "/tmp/keepstate-npm/cache"]
        if HOST_CA_BUNDLE.is_file():
            shutil.copy(HOST_CA_BUNDLE, scratch / "ca.crt")
            opts += ["--cafile", "/tmp/keepstate-npm/ca.crt"]
        _chroot(rootfs, shlex.join(["npm", "install", "-g", *opts, *packages]), "npm install")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _read_built(d: Definition, ddigest: str) -> Built | None:
    final = templates_dir() / d.name / ddigest
    meta = final / "build.json"
    if not meta.exists():
        return None
    info = json.loads(meta.read_text())
    return Built(name=d.name, definition_digest=ddigest, digest=info["digest"], rootfs=final / "rootfs",
                 defaults=d.defaults, built_at=info["built_at"])


def _parent_built(d: Definition, progress: Progress) -> Built | None:
    return ensure_built(d.parent, progress) if d.parent else None


def current(name: str) -> Built | None:
    """The built template for the current definition, without building."""
    d = load(name)
    parent = current(d.parent) if d.parent else None
    if d.parent and parent is None:
        return None
    return _read_built(d, definition_digest(d, parent.digest if parent else None))


def latest(name: str) -> Built | None:
    """The newest completed build of a template, whether or not its definition changed since.

    Running servers use this: a definition edited under a live server is rebuilt at the next
    start or by `keepstate template build`, never in the middle of a create request.
    """
    d = load(name)
    link = templates_dir() / name / "current"
    if not link.is_symlink():
        return None
    return _read_built(d, os.readlink(link))


def find_by_digest(name: str, digest: str) -> Built | None:
    """A build of `name` whose root filesystem has this digest, if this host still has one."""
    d = load(name)
    for meta in sorted((templates_dir() / name).glob("*/build.json")):
        try:
            info = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        if info.get("digest") == digest and not meta.parent.name.startswith("."):
            return Built(name=name, definition_digest=meta.parent.name, digest=digest,
                         rootfs=meta.parent / "rootfs", defaults=d.defaults, built_at=info["built_at"])
    return None


def ensure_built(name: str, progress: Progress = stderr_progress, force: bool = False) -> Built:
    d = load(name)
    parent = _parent_built(d, progress)
    ddigest = definition_digest(d, parent.digest if parent else None)
    if not force and (b := _read_built(d, ddigest)) is not None:
        return b
    tdir = templates_dir() / d.name
    tdir.mkdir(parents=True, exist_ok=True)
    with open(tdir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and (b := _read_built(d, ddigest)) is not None:
            return b
        return _build(d, ddigest, parent, progress)


def _build(d: Definition, ddigest: str, parent: Built | None, progress: Progress) -> Built:
    if os.geteuid() != 0:
        raise Unavailable("building templates needs root (debootstrap, chroot); run `make setup` first")
    tdir = templates_dir() / d.name
    work = tdir / f".build-{ddigest[:12]}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    rootfs = work / "rootfs"
    started = time.monotonic()
    steps = 6
    step = 0

    def say(msg: str) -> None:
        nonlocal step
        step += 1
        progress(f"template {d.name} [{step}/{steps}] {msg} ({time.monotonic() - started:.0f}s elapsed)")

    try:
        if parent is None:
            say(f"debootstrap {d.suite} ({d.variant}, {len(d.apt)} packages; about a minute)")
            cache = home() / "cache" / "debootstrap"
            cache.mkdir(parents=True, exist_ok=True)
            work.mkdir(parents=True)
            cmd = ["debootstrap", f"--variant={d.variant}", f"--cache-dir={cache}"]
            if d.apt:
                cmd.append("--include=" + ",".join(d.apt))
            _sh(cmd + [d.suite, str(rootfs), debian_mirror()], "debootstrap")
        else:
            say(f"copy parent template {parent.name}")
            work.mkdir(parents=True)
            _sh(["cp", "-a", "--reflink=auto", str(parent.rootfs), str(rootfs)], "copy of parent root")
            # The parent's resolv.conf names no resolver (sandboxes have none); the build's apt, npm and run
            # steps need the host's. _finish_root puts the sandbox's back.
            shutil.copy("/etc/resolv.conf", rootfs / "etc/resolv.conf")
            if d.apt:
                say(f"apt-get install {len(d.apt)} packages")
                _chroot(rootfs, "apt-get update -qq && apt-get install -y -qq --no-install-recommends "
                        + " ".join(d.apt) + " >/dev/null", "apt-get install")
        say("python packages")
        if parent is None:
            if reqs := agent_requirements():
                _pip_target(reqs, rootfs / "opt/keepstate/site", "agent dependencies")
            # Every mount point a sandbox's spec names exists in the build: runsc would otherwise create it in
            # this (shared, read-only to sandboxes) directory.
            for point in ("opt/keepstate/lib/keepstate", AGENT_RUNTIME.lstrip("/"), TEMPLATE_VIEW.lstrip("/"),
                          *(f"{VOLUMES_DIR.lstrip('/')}/{i}" for i in range(VOLUME_SLOTS))):
                (rootfs / point).mkdir(parents=True, exist_ok=True)
        if d.pip:
            _pip_target(d.pip, rootfs / "usr/local/lib/python3.11/dist-packages", "template pip packages")
        if d.npm:
            say(f"npm install -g {len(d.npm)} packages")
            _npm_install(rootfs, d.npm)
        else:
            step += 1
        say(f"{len(d.files)} files and {len(d.run)} set-up steps")
        for src, dest in d.files.items():  # first, so that the steps can use them (docs/design/templates.md)
            target = rootfs / dest.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(d.source.parent / src, target)
        for line in d.run:
            _chroot(rootfs, line, f"set-up step `{line}`")
        _finish_root(d, rootfs)
        say("digest of the root filesystem")
        digest = rootfs_digest(rootfs)
        packages = _sh(["chroot", str(rootfs), "dpkg-query", "-W", "-f=${Package}=${Version}\\n"],
                       "package list").split()
        built_at = time.time()
        (work / "build.json").write_text(json.dumps({
            "name": d.name, "definition_digest": ddigest, "digest": digest, "built_at": built_at,
            "parent": parent.digest if parent else None, "packages": packages,
            "seconds": round(time.monotonic() - started, 1),
        }, indent=1))
        final = tdir / ddigest
        if final.exists():
            # A forced rebuild: live sandboxes may still use the old root, so retire it, don't delete it.
            os.rename(final, tdir / f".retired-{ddigest[:12]}-{int(time.time())}")
        os.rename(work, final)
        link = tdir / "current"
        tmp_link = tdir / f".current-{os.getpid()}"
        tmp_link.unlink(missing_ok=True)
        tmp_link.symlink_to(ddigest)
        os.replace(tmp_link, link)
        progress(f"template {d.name} built in {time.monotonic() - started:.0f}s, digest {digest[:16]}")
        return Built(name=d.name, definition_digest=ddigest, digest=digest, rootfs=final / "rootfs",
                     defaults=d.defaults, built_at=built_at)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _finish_root(d: Definition, rootfs: Path) -> None:
    """Files every sandbox needs from us: defaults for the agent, names that resolve locally."""
    etc = rootfs / "etc"
    (etc / "keepstate").mkdir(parents=True, exist_ok=True)
    services = [s.__dict__ for s in d.services]
    inherited = etc / "keepstate" / "template.json"
    if inherited.exists():
        # A child template keeps its parent's services and adds its own.
        old = json.loads(inherited.read_text()).get("services", [])
        names = {s["name"] for s in services}
        services = [s for s in old if s["name"] not in names] + services
    inherited.write_text(json.dumps({
        "name": d.name, "user": d.defaults.user, "workdir": d.defaults.workdir,
        "env": d.defaults.env, "services": services,
    }, indent=1))
    (etc / "hosts").write_text("127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost\n")
    # No resolver is reachable from a sandbox: fail lookups at once instead of timing out.
    (etc / "resolv.conf").write_text("options timeout:1 attempts:1\n")
    shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
    (rootfs / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)


def list_built() -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    from .definition import load_all

    for name, d in sorted(load_all().items()):
        try:
            b = current(name)
        except KeepStateError:
            b = None
        out.append({
            "name": name, "description": d.description, "parent": d.parent,
            "built": b is not None, "digest": b.digest if b else None,
            "definition_digest": b.definition_digest if b else None,
            "cpu": d.defaults.cpu, "memory_mb": d.defaults.memory_mb,
            "built_at": b.built_at if b else None,
        })
    return out




__all__ = ["rootfs_digest", "sandbox_wheel_args"]  # keepstate.rootfs's, long called from here
