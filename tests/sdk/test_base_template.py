"""The `base` template has what agents expect of E2B's base image (shared/docs/e2b-protocol-more.md section 8):
`python` and `pip`, `node` and `npm`, a C toolchain, `git`, `gh`, and a `pip install` that works."""

from __future__ import annotations

import pytest
from e2b import Sandbox


@pytest.mark.parametrize("command", [
    "python -c 'import sys; assert sys.version_info[:2] == (3, 11)'",
    "pip --version && pip3 --version && python -m pip --version",
    "node -e 'process.exit(1 + 1 === 2 ? 0 : 1)' && npm --version",
    "git --version && gh --version && curl --version && make --version",
    "python -m venv /tmp/venv && /tmp/venv/bin/python -c 'import sys; assert sys.prefix == \"/tmp/venv\"'",
])
def test_the_tools_are_there(sandbox: Sandbox, command: str) -> None:
    result = sandbox.commands.run(command)
    assert result.exit_code == 0, result.stderr


def test_a_c_program_builds_and_runs(sandbox: Sandbox) -> None:
    sandbox.files.write("/home/user/hello.c", '#include <stdio.h>\nint main(void) { puts("built here"); }\n')
    result = sandbox.commands.run("cd /home/user && gcc -o hello hello.c && ./hello")
    assert result.stdout == "built here\n"


def test_pip_installs_for_the_user_without_an_index(sandbox: Sandbox) -> None:
    """No PEP 668 refusal: E2B's image lets `pip install` write; here into ~/.local, offline from a local tree."""
    sandbox.files.write("/home/user/kspkg/pyproject.toml",
                        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
                        '[project]\nname = "kspkg"\nversion = "1.0"\n')
    sandbox.files.write("/home/user/kspkg/kspkg.py", "ANSWER = 42\n")
    result = sandbox.commands.run("pip install --no-index --no-build-isolation /home/user/kspkg"
                                  " && cd / && python -c 'import kspkg; print(kspkg.ANSWER)'", timeout=120)
    assert result.stdout.strip().endswith("42"), result.stderr
