"""The package's public names are deliberate: an accidental export fails here."""

import keepstate.session


def test_all() -> None:
    assert sorted(keepstate.session.__all__) == sorted([
        "DB_FILE", "GENESIS", "CheckpointRow", "Event", "EventLog", "EventRef", "Executor", "JournalBusy",
        "JournalError", "JournalPoller", "Lineage", "ReplayReport", "Replayer", "SessionRecorder",
        "SessionRow", "Step", "StepResult", "VerifyResult", "canonical", "event_hash", "plan", "pull_journal",
        "verify_events"])
    for name in keepstate.session.__all__:
        assert hasattr(keepstate.session, name), name
