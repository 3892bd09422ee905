"""`keepstate store` and `keepstate checkpoint`, run as real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from keepstate.store import CheckpointMeta, ImageFile, LocalBackend, Repository
from tests.store.conftest import MiB, S3Server, write_memory_image


def ks(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KEEPSTATE_HOME": str(home)}
    env.pop("KEEPSTATE_STORE", None)
    return subprocess.run([sys.executable, "-m", "keepstate.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.fixture
def home(tmp_path: Path) -> tuple[Path, list[str]]:
    """$KEEPSTATE_HOME with a default store holding two checkpoints."""
    home = tmp_path / "home"
    repo = Repository.open(LocalBackend(home / "store"))
    img = tmp_path / "pages.img"
    write_memory_image(img, 2 * MiB, seed=70)
    first = repo.write_checkpoint([ImageFile("pages.img", img, "memory")], CheckpointMeta(session_id="s1"))
    second = repo.write_checkpoint([ImageFile("pages.img", img, "memory")],
                                   CheckpointMeta(session_id="s2", parent_id=first.checkpoint_id))
    return home, [first.checkpoint_id, second.checkpoint_id]


def test_ls(home: tuple[Path, list[str]]) -> None:
    root, ids = home
    listed = json.loads(ks(root, "checkpoint", "ls", "--json").stdout)
    assert [c["checkpoint_id"] for c in listed] == ids
    assert listed[1]["parent_id"] == ids[0] and listed[0]["size"] == 2 * MiB
    only = json.loads(ks(root, "checkpoint", "ls", "--json", "--session", "s2").stdout)
    assert [c["checkpoint_id"] for c in only] == [ids[1]]
    table = ks(root, "checkpoint", "ls")
    assert table.returncode == 0 and ids[0] in table.stdout and "CHECKPOINT" in table.stdout


def test_verify_commands_and_exit_codes(home: tuple[Path, list[str]]) -> None:
    root, ids = home
    ok = ks(root, "store", "verify", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"] is True
    one = ks(root, "checkpoint", "verify", ids[0], "--json")
    assert one.returncode == 0 and json.loads(one.stdout)["checkpoint_id"] == ids[0]

    pack = next((root / "store" / "packs").rglob("*"))
    while pack.is_dir():
        pack = next(pack.iterdir())
    data = bytearray(pack.read_bytes())
    data[100] ^= 1
    pack.write_bytes(bytes(data))
    bad = ks(root, "store", "verify", "--json")
    assert bad.returncode == 1
    assert any(p["kind"] == "pack" and p["name"] == pack.name for p in json.loads(bad.stdout)["problems"])
    human = ks(root, "checkpoint", "verify", ids[1])
    assert human.returncode == 1 and "PROBLEM pack" in human.stdout

    missing = ks(root, "checkpoint", "verify", "NOSUCHCHECKPOINT", "--json")
    assert missing.returncode == 3
    error = json.loads(missing.stdout)
    assert error["code"] == 404 and "NOSUCHCHECKPOINT" in error["message"] and missing.stderr == ""


def test_gc(home: tuple[Path, list[str]]) -> None:
    root, ids = home
    Repository.open(LocalBackend(root / "store")).delete_checkpoint(ids[0])
    out = ks(root, "store", "gc", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["manifests_removed"] == 1
    assert "removed 0 pack(s)" in ks(root, "store", "gc").stdout


def test_export_import_to_another_store(home: tuple[Path, list[str]], tmp_path: Path, s3_server: S3Server) -> None:
    root, ids = home
    archive = tmp_path / "cp.ksx"
    exported = ks(root, "checkpoint", "export", ids[1], str(archive), "--json")
    assert exported.returncode == 0, exported.stderr
    assert json.loads(exported.stdout)["bytes"] == archive.stat().st_size
    assert "exporting" in exported.stderr  # the progress bar goes to stderr

    url = s3_server.url("cli-import")
    imported = ks(root, "checkpoint", "import", str(archive), "--store", url, "--json")
    assert imported.returncode == 0, imported.stderr
    assert json.loads(imported.stdout)["checkpoint_id"] == ids[1]
    listed = json.loads(ks(root, "checkpoint", "ls", "--store", url, "--json").stdout)
    assert [c["checkpoint_id"] for c in listed] == [ids[1]]

    damaged = tmp_path / "damaged.ksx"
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 1
    damaged.write_bytes(bytes(data))
    refused = ks(root, "checkpoint", "import", str(damaged), "--store", (tmp_path / "other").as_uri())
    assert refused.returncode == 4 and "error:" in refused.stderr


def test_clear_errors(tmp_path: Path) -> None:
    nowhere = ks(tmp_path / "empty-home", "checkpoint", "ls")
    assert nowhere.returncode == 3 and "no checkpoint store" in nowhere.stderr
    bad_url = ks(tmp_path, "store", "verify", "--store", "ftp://x/y")
    assert bad_url.returncode == 2 and "--store" in bad_url.stderr
    no_file = ks(tmp_path, "checkpoint", "import", str(tmp_path / "nope.ksx"))
    assert no_file.returncode == 3
