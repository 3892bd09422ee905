"""Writes tests/db/legacy/home: a data directory as the release before the one database wrote it (8cf4d29), with
the rows every table of its three files can hold. Run it with that release's code first on the path:

    git archive 8cf4d29 keepstate | tar -x -C /tmp/oldrel
    PYTHONPATH=/tmp/oldrel .venv/bin/python tests/db/legacy/make_home.py tests/db/legacy/home

The files it writes are committed; tests/db/test_legacy.py imports them and checks what it finds.
"""

# ruff: noqa: I001 - imports the modules of the release before this one, which this release no longer has
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from keepstate.db.catalog import BuildRecord, Catalog, TemplateRecord
from keepstate.gateway.store import Attempt, Mark, Position, Run, Store
from keepstate.gateway.usage import Usage
from keepstate.sandbox.record import Instance, SandboxRow, Settings
from keepstate.sandbox.state import State
from keepstate.secret import SecretStore
from keepstate.secret.crypto import Sealer
from keepstate.session.db import CheckpointRow, SessionDB, SessionRow
from keepstate.volume.record import VolumeRecord

KEY = bytes(range(32))  # the secrets key the test opens them with
NOW = 1_764_000_000.0


def main(home: Path) -> None:
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    cat = Catalog(home / "catalog.sqlite")
    key, secret = cat.create_key("legacy", key="e2b_" + "ab" * 20, max_sandboxes=3)
    cat.create_key("revoked", key="e2b_" + "cd" * 20)
    cat.revoke_key(cat.list_keys()[1].id)
    running = SandboxRow(sandbox_id="sbrunning", state=State.RUNNING, template_id="base", template_digest="d1",
                         runtime_name="ks-0001", slot=7, address="10.88.0.30", access_token="tok1", started_at=NOW,
                         end_at=NOW + 300, cpu=1.0, memory_mb=512, api_key_id=key.id,
                         settings=Settings(session_id="sbrunning", metadata={"k": "v"}))
    paused = SandboxRow(sandbox_id="sbpaused", state=State.PAUSED, template_id="base", template_digest="d1",
                        runtime_name="", slot=-1, address="", access_token="tok2", started_at=NOW, end_at=NOW,
                        cpu=2.0, memory_mb=1024, api_key_id=key.id,
                        settings=Settings(session_id="sbpaused", checkpoint_id="CP2",
                                          standby=Instance("ks-0002", 8, "10.88.0.34", since=NOW, mem=1 << 20)))
    cat.put_sandbox(running)
    cat.put_sandbox(paused)
    cat.put_snapshot("snapshot-cp1", ["my-snap", "other-name"], "CP1", "sbrunning", "base")
    cat.put_volume(VolumeRecord("vol-1", "data", "voltoken", 64, NOW))
    store = SecretStore(cat, Sealer(KEY))
    made = store.create("api-token", "s3cret-value", {"team": "a"})
    store.update(made.secret_id, "s3cret-value-2")
    cat.put_template(TemplateRecord("tpl-1", "my-template", 2, 1024, NOW, NOW))
    build = BuildRecord("bld-1", "tpl-1", "ready", NOW, checkpoint_id="CP3", sandbox_id="sbbuild",
                        reason=None, finished_at=NOW + 5)
    cat.put_build(build)
    cat.publish_build(build, ["latest", "v1"])
    cat.put_layer("build:bld-1", "CP3", {"user": "user", "workdir": "/home/user"})
    cat.put_teardown("ks-dead", 9)
    cat.close()

    sessions = SessionDB(home / "sessions.sqlite")
    sessions.upsert_session(SessionRow("sbrunning", "base", NOW, None, None, "running"))
    sessions.upsert_session(SessionRow("sbpaused", "base", NOW, "sbrunning", "CP1", "paused"))
    sessions.append_events([("sbrunning", "sandbox.create", {"template": "base"})], ts=NOW)
    sessions.append_events([("sbrunning", "process.exit", {"code": 0, "cmd": "echo héllo"})], ts=NOW + 1)
    sessions.append_events([("sbpaused", "sandbox.fork", {"from": "sbrunning"}),
                            ("sbpaused", "sandbox.pause", {"checkpoint": "CP2"})], ts=NOW + 2)
    sessions.set_journal_cursor("sbrunning", 5)
    sessions.insert_checkpoint(CheckpointRow("CP1", "sbrunning", None, "snapshot", 2, "h", 5, NOW + 1))
    sessions.insert_checkpoint(CheckpointRow("CP2", "sbpaused", "CP1", "pause", 2, "h2", None, NOW + 2))
    sessions.close()

    ledger = Store(home / "gateway.sqlite", owner="1:legacy")
    run = Run("run-1", "sbrunning", "sbrunning", key.id, None, "live", None, False, source_ip="10.88.0.30")
    ledger.create_run(run, "tokenhash", source_ip="10.88.0.30")
    ledger.set_budget("key", key.id, 1_000_000_000)
    ledger.add_position(Position("run-1", 0, "call-1", "bodyhash", "upstream", True, NOW, NOW + 1))
    attempt = Attempt("call-1", run, "openai", "gpt-4o-mini", "/v1/chat/completions", NOW)
    ledger.begin_upstream(attempt, False, "bodyhash", None, [("key", key.id)], 5000)
    ledger.finish_upstream(attempt, ok=True, outcome="ok", http_status=200, content_type="application/json",
                           response=b'{"ok":true}', usage=Usage(input_tokens=10, output_tokens=3), request_id="req1",
                           cost_nano=4200, priced=True)
    ledger.record_served("store", attempt, 1, 200)
    ledger.put_mark(Mark("CP1", "sbrunning", "run-1", 1))
    ledger.close()
    time.sleep(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
