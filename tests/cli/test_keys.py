"""`keepstate keys`: a key's own limit of running sandboxes, set at create or later (docs/design/admission.md)."""

from __future__ import annotations

import json
from pathlib import Path

from keepstate.db.catalog import Catalog

from .test_errors import ks


def test_a_keys_limit_is_set_at_create_and_changed_by_name_or_id(tmp_path: Path) -> None:
    made = ks(tmp_path, "keys", "create", "ci", "--max-sandboxes", "2")
    assert made.exit_code == 0, made.stderr
    secret = made.stdout.strip()
    key = Catalog(tmp_path / "catalog.sqlite").find_key(secret)
    assert key is not None and key.max_sandboxes == 2
    listed = json.loads(ks(tmp_path, "keys", "ls", "--json").stdout)
    assert [k["max_sandboxes"] for k in listed] == [2]
    assert "2 " in ks(tmp_path, "keys", "ls").stdout.splitlines()[1]

    for arg, want in (("5", 5), ("0", 0), ("default", None)):
        changed = ks(tmp_path, "keys", "limit", "ci", arg)
        assert changed.exit_code == 0, changed.stderr
        assert Catalog(tmp_path / "catalog.sqlite").get_key(key.id).max_sandboxes == want  # type: ignore[union-attr]
    assert ks(tmp_path, "keys", "limit", key.id, "7").exit_code == 0
    assert Catalog(tmp_path / "catalog.sqlite").get_key(key.id).max_sandboxes == 7  # type: ignore[union-attr]


def test_a_bad_limit_or_an_unknown_or_ambiguous_key_is_refused(tmp_path: Path) -> None:
    assert ks(tmp_path, "keys", "create", "ci").exit_code == 0
    assert ks(tmp_path, "keys", "create", "ci").exit_code == 0
    bad = ks(tmp_path, "keys", "limit", "ci", "many")
    assert bad.exit_code != 0 and "whole number" in bad.stderr
    ambiguous = ks(tmp_path, "keys", "limit", "ci", "3")
    assert ambiguous.exit_code != 0 and "2 active keys are named 'ci'" in ambiguous.stderr
    unknown = ks(tmp_path, "keys", "limit", "nobody", "3")
    assert unknown.exit_code != 0 and "no active key" in unknown.stderr
    negative = ks(tmp_path, "keys", "create", "x", "--max-sandboxes", "-1")
    assert negative.exit_code == 2
