"""A host virtualenv with the code-interpreter template's Python and Node packages.

The baseline of benchmarks/interpreter.py: a local Jupyter kernel outside any sandbox, with the
same pins. Built (once, under a file lock) from Debian's python3 with exactly the template's `pip`
pins, the template's `npm` packages in the same prefix, and the kernel specs the template's `run`
steps install — the same steps, with venv paths for /usr/local.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from keepstate.template.definition import definitions_dir

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = definitions_dir() / "code-interpreter-v1.toml"
# Bump when the build steps below change.
RECIPE = 3


def env_dir() -> Path:
    return Path(os.environ.get("KEEPSTATE_INTERP_VENV", REPO / ".venv-interp"))


def _template() -> dict:
    return tomllib.loads(TEMPLATE.read_text())


def _run(cmd: list[str], **kw: object) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=900, **kw)


def patch_tslab(prefix: Path) -> None:
    """The template's own tslab steps (its run lines that patch or check tslab's files), with the venv's prefix
    for /usr/local: one definition of the patches, so the baseline kernel behaves as the sandbox's does."""
    for line in _template()["run"]:
        if "node_modules/tslab/dist" in line:
            _run(["sh", "-ec", line.replace("/usr/local", str(prefix))])


def ensure() -> Path:
    """The venv's root, built if missing or stale."""
    root = env_dir()
    tpl = _template()
    stamp_value = hashlib.sha256(json.dumps([RECIPE, tpl["pip"], tpl["npm"], tpl["run"]]).encode()).hexdigest()
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = root / ".keepstate-stamp"
        if stamp.exists() and stamp.read_text() == stamp_value:
            return root
        shutil.rmtree(root, ignore_errors=True)
        python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
        _run([python, "-m", "venv", str(root)])
        py = str(root / "bin" / "python")
        _run([py, "-m", "pip", "install", "-q", "--no-deps", *tpl["pip"]])
        _run([py, "-m", "bash_kernel.install", "--sys-prefix"])
        if tpl["npm"] and shutil.which("npm"):
            _run(["npm", "install", "-g", "--prefix", str(root), *tpl["npm"]])
            _run([str(root / "bin" / "tslab"), "install", f"--python={py}", "--sys-prefix",
                  f"--binary={root / 'bin' / 'tslab'}"])
            patch_tslab(root)
        stamp.write_text(stamp_value)
    return root
