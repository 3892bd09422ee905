"""`keepstate keys`: a key's own limit of running sandboxes, set at create or later (docs/design/admission.md); the
database it writes (`--db`, KEEPSTATE_DB; by default `<home>/keepstate.sqlite`), and revoking by ID or by name."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from click.testing import CliRunner, Result

from keepstate.apikeys import find
from keepstate.cli.main import cli
from keepstate.db.engine import Database
from keepstate.db.records import KeyRecord
from keepstate.db.repos import Keys
from keepstate.db.url import default_url
from keepstate.testing.databases import db_url, postgres  # noqa: F401

from .test_errors import ks


def keys_on(home: Path, url: str, *args: str) -> Result:
    """`keepstate keys ARGS --db URL`. KEEPSTATE_DB is in the runner's environment so that it is put back after:
    `--db` sets it in this process."""
    env = {"KEEPSTATE_HOME": str(home), "KEEPSTATE_DB": None, "KEEPSTATE_STORE": None, "E2B_API_KEY": None,
           "E2B_API_URL": None}
    return CliRunner(env=env).invoke(cli, ["keys", *args, "--db", url], prog_name="keepstate",
                                     catch_exceptions=False)


def read(url: str, secret: str | None = None, key_id: str | None = None) -> KeyRecord | None:
    """The active key of `secret`, or the key `key_id`, as the database has it now (a Database of its own)."""

    async def main() -> KeyRecord | None:
        db = await Database.open(url)
        try:
            return await find(Keys(db), secret) if secret is not None else await Keys(db).get(key_id or "")
        finally:
            await db.close()

    return asyncio.run(main())


def test_a_keys_limit_is_set_at_create_and_changed_by_name_or_id(tmp_path: Path) -> None:
    url = default_url(tmp_path)  # where the CLI writes without --db or KEEPSTATE_DB
    made = ks(tmp_path, "keys", "create", "ci", "--max-sandboxes", "2")
    assert made.exit_code == 0, made.stderr
    secret = made.stdout.strip()
    assert (tmp_path / "keepstate.sqlite").is_file() and not (tmp_path / "catalog.sqlite").exists()
    key = read(url, secret)
    assert key is not None and key.max_sandboxes == 2
    listed = json.loads(ks(tmp_path, "keys", "ls", "--json").stdout)
    assert [k["max_sandboxes"] for k in listed] == [2]
    assert "2 " in ks(tmp_path, "keys", "ls").stdout.splitlines()[1]

    for arg, want in (("5", 5), ("0", 0), ("default", None)):
        changed = ks(tmp_path, "keys", "limit", "ci", arg)
        assert changed.exit_code == 0, changed.stderr
        assert read(url, key_id=key.id).max_sandboxes == want  # type: ignore[union-attr]
    assert ks(tmp_path, "keys", "limit", key.id, "7").exit_code == 0
    assert read(url, key_id=key.id).max_sandboxes == 7  # type: ignore[union-attr]


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


def test_keys_live_in_the_database_named_by_db_and_are_revoked_by_id_or_name(tmp_path: Path,
                                                                             db_url: str) -> None:  # noqa: F811
    home = tmp_path / "data"  # no database file goes there: the keys are in the one named by --db
    home.mkdir()

    def keys(*args: str) -> Result:
        return keys_on(home, db_url, *args)

    made = [keys("create", name) for name in ("ci", "dev", "dev")]
    assert all(m.exit_code == 0 for m in made), [m.stderr for m in made]
    ci, dev1, dev2 = (m.stdout.strip() for m in made)
    ci_key = read(db_url, ci)
    assert ci_key is not None and ci_key.name == "ci" and read(db_url, dev1) is not None
    listed = json.loads(keys("ls", "--json").stdout)
    assert [k["name"] for k in listed] == ["ci", "dev", "dev"] and all(k["revoked_at"] is None for k in listed)
    assert all(s not in json.dumps(listed) for s in (ci, dev1, dev2))  # secrets are never listed

    ambiguous = keys("revoke", "dev")
    assert ambiguous.exit_code != 0 and "2 active keys are named 'dev'" in ambiguous.stderr
    assert read(db_url, dev1) is not None and read(db_url, dev2) is not None  # the refusal revoked neither
    assert keys("revoke", "ci").exit_code == 0  # by name
    assert read(db_url, ci) is None
    dev1_id = read(db_url, dev1).id  # type: ignore[union-attr]
    assert keys("revoke", dev1_id).exit_code == 0  # by ID
    assert read(db_url, dev1) is None and read(db_url, dev2) is not None
    assert keys("revoke", "dev").exit_code == 0  # the one active key of that name now
    assert read(db_url, dev2) is None
    again = keys("revoke", dev1_id)
    assert again.exit_code != 0 and "no active key" in again.stderr
    assert [k["revoked_at"] is not None for k in json.loads(keys("ls", "--json").stdout)] == [True] * 3
    assert list(home.iterdir()) == []
