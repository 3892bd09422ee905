"""Template definitions parse strictly and their digest changes exactly when a build input changes."""

from __future__ import annotations

from pathlib import Path

import pytest

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
