"""What every sandbox root filesystem is made of and named by, shared by the runtime (runtime/agent_runtime.py
builds the agent's Python tree) and the template builders (keepstate.template): the agent's pinned requirements,
pip's options for the sandbox's Python, and the digest of a tree. Imports no keepstate package but errors-free
standard ones: both sides stand on it.
"""

from __future__ import annotations

import os
import platform
import re
from importlib import resources
from pathlib import Path

import blake3


def package_file(package: str, *parts: str) -> Path:
    """A data file installed with a keepstate package (package-data in pyproject.toml), wherever it lies."""
    return Path(str(resources.files(package).joinpath(*parts)))


# The agent's dependencies, every transitive one pinned (generated: scripts/agent-requirements.py).
AGENT_REQUIREMENTS = package_file("keepstate.agent", "requirements.txt")
# The agent's dependencies, every transitive one pinned (generated: scripts/agent-requirements.py).
AGENT_REQUIREMENTS = package_file("keepstate.agent", "requirements.txt")


def agent_requirements() -> list[str]:
    """The pinned requirement lines of AGENT_REQUIREMENTS, in file order, without comments and blank lines."""
    if not AGENT_REQUIREMENTS.exists():
        return []
    lines = (re.sub(r"(^|\s)#.*", "", line).strip() for line in AGENT_REQUIREMENTS.read_text().splitlines())
    return [line for line in lines if line]


def sandbox_wheel_args() -> list[str]:
    """`pip install` options that pick binary wheels for the sandbox's Python (Debian bookworm: CPython 3.11);
    scripts/agent-requirements.py resolves the agent's pins with the same ones."""
    machine = platform.machine()
    # bookworm has glibc 2.36; pip does not widen an explicit platform, so list the older tags too.
    plats = [f"manylinux_2_{v}_{machine}" for v in (36, 35, 34, 31, 28, 27, 24, 17, 12, 5)]
    plats += [f"manylinux2014_{machine}", f"manylinux2010_{machine}", f"manylinux1_{machine}"]
    return ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
            "--abi", "abi3", "--abi", "none", *(x for p in plats for x in ("--platform", p))]


def rootfs_digest(rootfs: Path) -> str:
    """BLAKE3 over the sorted tree: paths, modes, owners, link targets and file contents.

    Times are left out so two builds of the same packages hash the same.
    """
    h = blake3.blake3()
    for dirpath, dirnames, filenames in os.walk(rootfs):
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]):
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, rootfs)
            h.update(f"{rel}\0{st.st_mode:o}\0{st.st_uid}\0{st.st_gid}\0".encode())
            if os.path.islink(p):
                h.update(os.readlink(p).encode())
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
    return h.hexdigest()
