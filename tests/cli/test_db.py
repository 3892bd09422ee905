"""`keepstate db`: status, upgrade, and the explicit import of an older release's files into PostgreSQL."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from click.testing import CliRunner, Result

from keepstate.cli.main import cli
from keepstate.testing.databases import postgres  # noqa: F401
from keepstate.testing.postgres import PostgresServer

LEGACY = Path(__file__).parents[1] / "db" / "legacy" / "home"


def ks(home: Path, db: str, *args: str) -> Result:
    env = {"KEEPSTATE_HOME": str(home), "KEEPSTATE_DB": db}
    return CliRunner(env=env).invoke(cli, list(args), prog_name="keepstate", catch_exceptions=False)


def test_import_into_postgres_then_status(tmp_path: Path, postgres: PostgresServer) -> None:  # noqa: F811
    home = tmp_path / "home"
    shutil.copytree(LEGACY, home)
    url = postgres.createdb("cli_import")
    before = ks(tmp_path, url, "db", "status", "--json")
    assert before.exit_code == 0, before.output
    shown = json.loads(before.stdout)
    assert shown["revision"] == [] and len(shown["files"]) == 0  # --home is tmp_path: nothing there
    done = ks(tmp_path, url, "db", "import", "--from", str(home))
    assert done.exit_code == 0, done.output
    assert "2 api_keys" in done.stderr and "4 events" in done.stderr
    assert sorted(p.name for p in home.iterdir()) == ["catalog.sqlite.imported", "gateway.sqlite.imported",
                                                      "sessions.sqlite.imported"]
    after = json.loads(ks(tmp_path, url, "db", "status", "--json").stdout)
    assert after["revision"] == [after["release"]]
    listed = ks(tmp_path, url, "keys", "ls", "--json")  # the imported keys, read through the same --db
    assert sorted(k["name"] for k in json.loads(listed.stdout)) == ["legacy", "revoked"]
    again = ks(tmp_path, url, "db", "import", "--from", str(home))
    assert again.exit_code == 3 and "holds no catalog.sqlite" in again.stderr


def test_status_names_files_left_to_import(tmp_path: Path) -> None:
    home = tmp_path / "home"
    shutil.copytree(LEGACY, home)
    url = f"sqlite:///{tmp_path}/elsewhere.sqlite"
    out = ks(home, url, "db", "status")
    assert out.exit_code == 0, out.output
    assert "not imported yet" in out.stdout and "catalog.sqlite" in out.stdout
    assert ks(home, url, "db", "upgrade").exit_code == 0
