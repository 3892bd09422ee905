"""Template definitions parse strictly and their digest changes exactly when a build input changes."""

from __future__ import annotations

import glob
import shutil
import tomllib
from importlib import resources
from pathlib import Path

import pytest

from keepstate import rootfs
from keepstate.errors import BadRequest
from keepstate.template import definition


def write(tmp: Path, text: str) -> Path:
    p = tmp / "t.toml"
    p.write_text(text)
    return p


def test_repo_templates_parse() -> None:
    defs = definition.load_all()
    assert "base" in defs and defs["base"].defaults.user == "user"
    assert "code-interpreter-v1" in defs and defs["code-interpreter-v1"].parent == "base"


def test_digest_tracks_inputs(tmp_path: Path) -> None:
    a = definition.parse(write(tmp_path, 'name = "t"\napt = ["bash"]\n'))
    b = definition.parse(write(tmp_path, 'name = "t"\napt = ["bash", "git"]\n'))
    assert definition.definition_digest(a, None) == definition.definition_digest(a, None)
    assert definition.definition_digest(a, None) != definition.definition_digest(b, None)
    assert definition.definition_digest(a, "p1") != definition.definition_digest(a, "p2")


def test_bad_definitions_are_refused(tmp_path: Path) -> None:
    for text in ('apt = ["x"]\n', 'name = "t"\napt = "bash"\n', "name = \n"):
        with pytest.raises(BadRequest):
            definition.parse(write(tmp_path, text))


def test_definitions_and_agent_requirements_are_package_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found inside the installed package (importlib.resources), not beside a source checkout."""
    monkeypatch.delenv("KEEPSTATE_TEMPLATES", raising=False)
    package = Path(str(resources.files("keepstate")))
    assert definition.definitions_dir() == definition.BUILTIN_DEFINITIONS == package / "template" / "definitions"
    assert rootfs.AGENT_REQUIREMENTS == package / "agent" / "requirements.txt"
    assert rootfs.AGENT_REQUIREMENTS.is_file() and definition.agent_requirements()
    assert {d.source.parent for d in definition.load_all().values()} == {definition.BUILTIN_DEFINITIONS}
    assert not hasattr(definition, "REPO_ROOT")
    # ... and shipped: pyproject's package data covers every file of the definitions folder.
    patterns = tomllib.loads((package.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {f for p in patterns["keepstate.template"]  # setuptools expands them with glob(recursive=True)
               for f in glob.glob(p, root_dir=package / "template", recursive=True)}
    files = {f.relative_to(package / "template").as_posix() for f in definition.BUILTIN_DEFINITIONS.rglob("*")
             if f.is_file() and "__pycache__" not in f.parts}
    assert {"definitions/base.toml", "definitions/code-interpreter-v1.toml"} <= files <= shipped


def test_templates_override_and_digest_ignores_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builtin = {n: definition.definition_digest(d, "p") for n, d in definition.load_all().items()}
    shutil.copytree(definition.BUILTIN_DEFINITIONS, tmp_path / "defs")
    monkeypatch.setenv("KEEPSTATE_TEMPLATES", str(tmp_path / "defs"))
    moved = definition.load_all()
    assert {d.source.parent for d in moved.values()} == {tmp_path / "defs"}
    assert {n: definition.definition_digest(d, "p") for n, d in moved.items()} == builtin


def test_copied_files_are_relative_to_the_definition(tmp_path: Path) -> None:
    (tmp_path / "motd").write_text("hello\n")
    d = definition.parse(write(tmp_path, 'name = "t"\n[files]\n"motd" = "/etc/motd"\n'))
    before = definition.definition_digest(d, None)
    (tmp_path / "motd").write_text("bye\n")
    assert definition.definition_digest(d, None) != before


def test_agent_requirements_comments_do_not_change_the_digest(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    root = definition.parse(write(tmp_path, 'name = "t"\n'))
    reqs = tmp_path / "requirements.txt"
    monkeypatch.setattr(rootfs, "AGENT_REQUIREMENTS", reqs)
    reqs.write_text("a==1\nb==2\n")
    plain = definition.definition_digest(root, None)
    reqs.write_text("# generated, do not edit\na==1  # why\n\nb==2\n")
    assert definition.agent_requirements() == ["a==1", "b==2"]
    assert definition.definition_digest(root, None) == plain
    reqs.write_text("a==1\nb==3\n")
    assert definition.definition_digest(root, None) != plain


def test_agent_requirements_hold_the_agent_extra() -> None:
    """requirements.txt is generated from pyproject's `agent` extra (scripts/agent-requirements.py --check proves
    the whole file; this is the offline part): every pin of the extra is in it, same version."""
    pyproject = Path(str(resources.files("keepstate"))).parent / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["agent"]
    pins = set(definition.agent_requirements())
    assert extra and all(req in pins for req in extra), set(extra) - pins
    assert "keepstate[agent]" in tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    assert rootfs.AGENT_REQUIREMENTS.read_text().startswith("# Generated by scripts/agent-requirements.py")
