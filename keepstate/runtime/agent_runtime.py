"""The agent runtime: a CPython, the agent's pinned dependencies and every library they load, glibc's loader
included, in one directory built once on the host and mounted read-only into every sandbox, so the agent depends
on nothing of the image (docs/design/agent-runtime.md).

Content-addressed: the directory is named by the BLAKE3 digest of its tree, so a checkpoint records the runtime
it ran on and a restore mounts that one. An *input key* over what a build reads maps a host to its runtime
without hashing the tree at every server start.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from keepstate.mountpoints import AGENT_PACKAGE, AGENT_RUNTIME
from keepstate.rootfs import agent_requirements, rootfs_digest, sandbox_wheel_args

RUNTIME_VERSION = 1  # bump when the layout or what is copied changes: the input key changes with it
FORMAT = 1  # runtime.json's own version
PYTHON_VERSION = "3.11"
LOADER = "ld-linux-x86-64.so.2"
# Left out of the standard library: tests, GUIs, the bundled pip, the static library, Debian's site hooks.
_STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "site-packages",
                "dist-packages", "sitecustomize.py", "EXTERNALLY-MANAGED", "__phello__"}
_STDLIB_SKIP_PREFIX = ("config-",)
_DYNLOAD_SKIP = re.compile(r"^(_test|_xx|xx|_ctypes_test|nis|_dbm|_gdbm|readline|_curses|ossaudiodev|audioop|_tkinter)")
# What glibc opens at run time rather than at link time: NSS's files module (users, groups) and libgcc_s
# (unwinding at pthread_exit / cancellation).
_RUNTIME_OPENED = ("libnss_files.so.2", "libgcc_s.so.1")

Progress = Callable[[str], None]


class RuntimeBuildError(RuntimeError):
    """The agent runtime could not be built; the message says what was missing."""


@dataclass(frozen=True)
class Sources:
    """The host files a runtime is made of (Debian bookworm's, by default)."""

    python: Path = Path("/usr/bin/python3.11")
    stdlib: Path = Path("/usr/lib/python3.11")
    tini: Path = Path("/usr/bin/tini-static")
    setpriv: Path = Path("/usr/bin/setpriv")
    libdirs: tuple[Path, ...] = (Path("/lib/x86_64-linux-gnu"), Path("/usr/lib/x86_64-linux-gnu"))
    requirements: tuple[str, ...] = field(default_factory=tuple)

    def key_files(self) -> list[Path]:
        """The files whose change (an upgrade of python3.11, libc6, tini, util-linux) means another runtime."""
        return [self.python, self.stdlib / "os.py", self.tini, self.setpriv,
                *(d / name for d in self.libdirs[:1] for name in ("libc.so.6", "libm.so.6", "libssl.so.3"))]


def default_sources() -> Sources:
    return Sources(requirements=tuple(agent_requirements()))


@dataclass(frozen=True)
class AgentRuntime:
    """A built runtime: its digest and where it lies on the host."""

    digest: str
    path: Path

    def python_argv(self, *args: str, at: str | None = None) -> list[str]:
        """The runtime's python3 started through the runtime's loader, as found at `at` (default: the host path;
        in a sandbox it is AGENT_RUNTIME)."""
        return loader_argv(at or str(self.path), "bin/python3", "-I", "-S", *args)


def loader_argv(root: str, program: str, *args: str) -> list[str]:
    """`program` (relative to `root`) run by the runtime's loader with the runtime's libraries only."""
    return [f"{root}/lib/{LOADER}", "--inhibit-cache", "--library-path", f"{root}/lib", f"{root}/{program}", *args]


def agent_argv(root: str = AGENT_RUNTIME, lib: str = AGENT_PACKAGE) -> list[str]:
    """The sandbox's process: tini (static) as PID 1, then the agent on the runtime's Python."""
    return [f"{root}/bin/tini", "-s", "-g", "--",
            *loader_argv(root, "bin/python3", "-I", "-S", "-u", "-B", f"{lib}/keepstate/agent/boot.py")]


# -- where ----------------------------------------------------------------------------------------------------
DEFAULT_CACHE = Path("/var/lib/keepstate/agent-runtime")


def cache_dir() -> Path:
    """$KEEPSTATE_AGENT_RUNTIME_CACHE, else /var/lib/keepstate/agent-runtime: one per host, whatever a server's data
    directory or templates cache (a server on a cache of its own would otherwise build its own runtime, and its
    wheels would have to come from PyPI again)."""
    if env := os.environ.get("KEEPSTATE_AGENT_RUNTIME_CACHE"):
        return Path(env)
    return DEFAULT_CACHE


def input_key(sources: Sources) -> str:
    h = hashlib.sha256(f"agent-runtime {RUNTIME_VERSION}\n".encode())
    h.update(Path(__file__).read_bytes())  # how it is built: a changed builder makes another runtime
    for line in sources.requirements:
        h.update(f"pin {line}\n".encode())
    for p in sources.key_files():
        try:
            st = os.stat(p)
        except OSError as exc:
            raise RuntimeBuildError(f"{p} is missing ({exc.strerror}): the agent runtime is made of it; "
                                    "run scripts/setup-host.sh") from None
        h.update(f"file {p} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def find(digest: str, root: Path | None = None) -> AgentRuntime | None:
    """The runtime of this digest, if this host has it."""
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        return None
    path = (root or cache_dir()) / digest
    return AgentRuntime(digest, path) if (path / "runtime.json").is_file() else None


_ensure_lock = threading.Lock()


def ensure(progress: Progress | None = None, sources: Sources | None = None,
           root: Path | None = None) -> AgentRuntime:
    """This host's runtime: found by input key, else built (the first time: PyPI for the wheels)."""
    sources = sources or default_sources()
    root = root or cache_dir()
    key = input_key(sources)
    known = root / "inputs" / key
    with _ensure_lock:
        if known.is_file() and (rt := find(known.read_text().strip(), root)) is not None:
            return rt
        root.mkdir(parents=True, exist_ok=True)
        with open(root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if known.is_file() and (rt := find(known.read_text().strip(), root)) is not None:
                return rt
            work = root / f".build-{os.getpid()}-{threading.get_ident()}"
            shutil.rmtree(work, ignore_errors=True)
            try:
                build(work, sources, root / "wheels", progress)
                digest = tree_digest(work)
                final = root / digest
                if final.exists():
                    shutil.rmtree(work)
                else:
                    os.rename(work, final)
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
            known.parent.mkdir(parents=True, exist_ok=True)
            tmp = known.with_name(f".{key}.{os.getpid()}")
            tmp.write_text(digest + "\n")
            os.replace(tmp, known)
            if progress:
                progress(f"agent runtime {digest[:16]} ready")
            return AgentRuntime(digest, final)


def tree_digest(path: Path) -> str:
    return rootfs_digest(path)


# -- build ----------------------------------------------------------------------------------------------------
def build(dest: Path, sources: Sources, wheels: Path, progress: Progress | None = None,
          download: bool = True) -> None:
    """Lay a runtime out in `dest` (which must not exist). Deterministic for one host's files and pins.
    `download`: fetch missing wheels from PyPI into `wheels` (else a missing one is an error)."""
    say = progress or (lambda _msg: None)
    dest.mkdir(parents=True)
    for d in ("bin", "lib", "site"):
        (dest / d).mkdir()
    say("agent runtime: python and its standard library")
    _copy_file(sources.python, dest / "bin/python3", 0o755)
    _copy_file(sources.tini, dest / "bin/tini", 0o755)
    _copy_file(sources.setpriv, dest / "bin/setpriv", 0o755)
    stdlib = dest / "lib" / f"python{PYTHON_VERSION}"
    _copy_stdlib(sources.stdlib, stdlib)
    say("agent runtime: the agent's pinned dependencies")
    _install_pins(list(sources.requirements), dest / "site", wheels, download)
    say("agent runtime: shared libraries")
    needed: dict[str, Path] = {}
    for elf in (dest / "bin/python3", dest / "bin/setpriv"):
        missing = _needed_libs(elf, needed, inside=dest)
        if missing:
            raise RuntimeBuildError(f"{elf.name} needs {', '.join(missing)}, which this host lacks")
    for module in sorted((stdlib / "lib-dynload").glob("*.so")):
        if _needed_libs(module, needed, inside=dest):
            module.unlink()  # e.g. a module of a library this host lacks: the agent uses none of those
    for module in sorted(p for p in (dest / "site").rglob("*.so*") if p.is_file()):
        missing = _needed_libs(module, needed, inside=dest)
        if missing:
            raise RuntimeBuildError(f"{module.relative_to(dest)} needs {', '.join(missing)}")
    for opened in _RUNTIME_OPENED:
        for libdir in sources.libdirs:
            if (libdir / opened).exists():
                needed.setdefault(opened, libdir / opened)
                _needed_libs(libdir / opened, needed, inside=dest)
                break
    if LOADER not in needed:
        raise RuntimeBuildError(f"ldd named no {LOADER} for python3: not a glibc x86-64 host?")
    for name, src in sorted(needed.items()):
        _copy_file(src, dest / "lib" / name, 0o755)
    say("agent runtime: compiling the dependencies")
    _compile(dest)
    version = subprocess.run(loader_argv(str(dest), "bin/python3", "-I", "-S", "-c",
                                         "import sys; print(sys.version.split()[0]); print(sys.prefix)"),
                             capture_output=True, text=True, timeout=60)
    lines = version.stdout.split()
    if version.returncode != 0 or len(lines) != 2 or lines[1] != str(dest):
        raise RuntimeBuildError(f"the runtime's python does not start on its own: {version.stderr.strip()[-800:]}"
                                f" (prefix {lines[1:]!r})")
    (dest / "runtime.json").write_text(json.dumps({
        "format": FORMAT, "version": RUNTIME_VERSION, "input_key": input_key(sources), "python": lines[0],
        "libraries": sorted(needed), "requirements": list(sources.requirements),
    }, indent=1) + "\n")
    for p in [dest, *dest.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, 0o755 if p.is_dir() or os.stat(p).st_mode & 0o111 else 0o644)


def _copy_file(src: Path, dst: Path, mode: int) -> None:
    try:
        shutil.copy2(src, dst)  # follows links: nothing in the runtime points outside it
    except OSError as exc:
        raise RuntimeBuildError(f"cannot copy {src} into the agent runtime: {exc.strerror}") from None
    os.chmod(dst, mode)


def _copy_stdlib(src: Path, dst: Path) -> None:
    """The stdlib with Debian's .pyc files, mtimes kept (a timestamp .pyc stays valid only so)."""
    def ignore(folder: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n in _STDLIB_SKIP or n.startswith(_STDLIB_SKIP_PREFIX)}
        if os.path.basename(folder) == "lib-dynload":
            skip |= {n for n in names if _DYNLOAD_SKIP.match(n)}
        return skip

    if not (src / "os.py").is_file():
        raise RuntimeBuildError(f"no Python standard library at {src}: install python3.11")
    shutil.copytree(src, dst, symlinks=False, ignore=ignore, ignore_dangling_symlinks=True)


def _ldd(elf: Path) -> list[tuple[str, str | None]]:
    """(name, resolved path or None when not found) of every library `ldd` lists for an ELF file."""
    proc = subprocess.run(["ldd", str(elf)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        if "not a dynamic executable" in proc.stdout + proc.stderr or "statically linked" in proc.stdout:
            return []
        raise RuntimeBuildError(f"ldd {elf} failed: {(proc.stderr or proc.stdout).strip()}")
    out: list[tuple[str, str | None]] = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if "=>" in line:
            name, _, rest = line.partition("=>")
            target = rest.strip().split(" (")[0].strip()
            out.append((name.strip(), None if target == "not found" else target))
        elif line.startswith("/"):
            path = line.split(" (")[0]
            out.append((os.path.basename(path), path))
        # linux-vdso.so.1 (no file) is the kernel's
    return [(n, p) for n, p in out if not n.startswith("linux-vdso")]


def _needed_libs(elf: Path, needed: dict[str, Path], inside: Path) -> list[str]:
    """Add what `elf` links to `needed` (by name); the names ldd could not find. Libraries already in the
    runtime (a wheel's own `.libs/`, found through its RUNPATH) are not copied again."""
    missing = []
    for name, path in _ldd(elf):
        if path is None:
            missing.append(name)
        elif not Path(path).resolve().is_relative_to(inside.resolve()):
            needed.setdefault(name, Path(path))
    return missing


def _pip(args: Iterable[str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args, *sandbox_wheel_args()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1800)


def _install_pins(pins: list[str], target: Path, wheels: Path, download: bool) -> None:
    """The exact pins, binary wheels only, from `wheels/`; downloaded there first when missing (PyPI)."""
    if not pins:
        return
    install = ["install", "--quiet", "--no-deps", "--no-compile", "--no-warn-script-location", "--no-index",
               "--find-links", str(wheels), "--target", str(target), *pins]
    if (first := _pip(install)).returncode != 0:
        if not download:
            raise RuntimeBuildError(f"the agent's wheels are not all in {wheels}: {first.stderr.strip()[-800:]}")
        wheels.mkdir(parents=True, exist_ok=True)
        got = _pip(["download", "--quiet", "--no-deps", "--dest", str(wheels), *pins])
        if got.returncode != 0:
            raise RuntimeBuildError(f"cannot download the agent's wheels: {got.stderr.strip()[-1500:]}")
        done = _pip(install)
        if done.returncode != 0:
            raise RuntimeBuildError(f"cannot install the agent's wheels: {done.stderr.strip()[-1500:]}")
    shutil.rmtree(target / "bin", ignore_errors=True)  # console scripts name the build's python: not ours


def _compile(dest: Path) -> None:
    """.pyc for the dependencies, by the runtime's own python, named as seen in a sandbox, valid whatever the
    files' times (unchecked hash)."""
    site = dest / "site"
    proc = subprocess.run(loader_argv(str(dest), "bin/python3", "-I", "-S", "-m", "compileall", "-q", "-j", "1",
                                      "--invalidation-mode", "unchecked-hash", "-s", str(dest), "-p",
                                      AGENT_RUNTIME, str(site)),
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeBuildError(f"compiling the agent's dependencies failed: {proc.stdout[-800:]}{proc.stderr[-800:]}")

