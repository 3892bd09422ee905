"""The catalog keeps keys hashed and sandboxes across reopen (what re-adoption relies on)."""

from __future__ import annotations

from pathlib import Path

from keepstate.db.catalog import Catalog, SandboxRow


def test_keys_and_sandboxes_survive_reopen(tmp_path: Path) -> None:
    cat = Catalog(tmp_path / "c.sqlite")
    key, secret = cat.create_key("ci")
    assert cat.find_key(secret).id == key.id and cat.find_key("nope") is None
    raw = (tmp_path / "c.sqlite").read_bytes()
    assert secret.encode() not in raw  # only hashes are stored
    row = SandboxRow("pool-1", "pooled", "base", "d", "ks-1", 3, "10.88.0.14", "", 1.0, 1.0, 2, 512)
    cat.put_sandbox(row)
    claimed = SandboxRow("abc", "running", "base", "d", "ks-1", 3, "10.88.0.14", "tok", 2.0, 302.0, 2, 512,
                         doc={"metadata": {"a": "b"}})
    cat.rename_sandbox("pool-1", claimed)
    cat.close()
    again = Catalog(tmp_path / "c.sqlite")
    assert again.get_sandbox("pool-1") is None
    got = again.get_sandbox("abc")
    assert got is not None and got.doc == {"metadata": {"a": "b"}} and got.runtime_name == "ks-1"
    assert again.revoke_key(key.id) and again.find_key(secret) is None
    again.put_snapshot("s1", ["n"], "CK", "abc", "base")
    assert again.get_snapshot("s1")["names"] == ["n"] and again.delete_snapshot("s1")
