"""The image-file kinds are spelled the same in docs/design/checkpoint-format.md and in the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from keepstate.store import ImageFile
from keepstate.store.chunker import ChunkerParams, chunks_of
from keepstate.store.manifest import KINDS

DOC = Path(__file__).resolve().parents[2] / "docs" / "design" / "checkpoint-format.md"


def test_kinds_and_their_codes_match_the_spec() -> None:
    text = DOC.read_text()
    codes = re.search(r"kind\s+\(1: `0` (\w+), `1` (\w+)\)", text)
    assert codes is not None and codes.groups() == KINDS == ("memory", "file")
    assert "| **kind** |" in text
    assert ImageFile("x", Path("x")).kind == "file"  # what the server passes for every file, pages.img included


def test_an_unknown_kind_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(b"x")
    with pytest.raises(ValueError, match="'memory' or 'file'"):
        next(iter(chunks_of(tmp_path / "x", "pages", ChunkerParams())))
