"""Sessions' causal history and lineage (docs/design/causal-history.md).

    log = EventLog(home() / "sessions.sqlite")
    ev = log.append(sandbox_id, "sandbox.create", {"template_id": "base", ...})
    log.verify(sandbox_id).ok
    lineage = Lineage(log.db)            # same file, same connection
    lineage.tree(sandbox_id)
"""

from keepstate.store.manifest import EventRef

from .chain import VerifyResult, verify_events
from .db import CheckpointRow, SessionDB, SessionRow
from .event import GENESIS, Event, canonical, event_hash
from .journal import JournalBusy, JournalError, JournalPoller, pull_journal
from .lineage import Lineage
from .log import EventLog
from .recorder import SessionRecorder
from .replay import Executor, Replayer, ReplayReport, Step, StepResult, plan

DB_FILE = "sessions.sqlite"

__all__ = [
    "DB_FILE", "GENESIS", "CheckpointRow", "Event", "EventLog", "EventRef", "Executor", "JournalBusy", "JournalError",
    "JournalPoller", "Lineage", "ReplayReport", "Replayer", "SessionDB", "SessionRecorder", "SessionRow", "Step",
    "StepResult", "VerifyResult", "canonical", "event_hash", "plan", "pull_journal", "verify_events",
]
