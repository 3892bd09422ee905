"""Sessions' causal history and lineage (docs/design/causal-history.md), in the server's one database.

    db = await Database.open(url)           # keepstate.db: one per process, shared by every component
    log = EventLog(db)
    ev = await log.append(sandbox_id, "sandbox.create", {"template_id": "base", ...})
    (await log.verify(sandbox_id)).ok
    lineage = Lineage(log.history)          # the same repository
    await lineage.tree(sandbox_id)
"""

from keepstate.store.manifest import EventRef

from .chain import VerifyResult, verify_events
from .event import GENESIS, Event, canonical, event_hash
from .journal import JournalBusy, JournalError, JournalPoller, pull_journal
from .lineage import CheckpointRow, Lineage, SessionRow
from .log import EventLog
from .recorder import SessionRecorder
from .replay import Executor, Replayer, ReplayReport, Step, StepResult, plan

DB_FILE = "sessions.sqlite"  # the file the history lived in before keepstate.db (what an import reads)

__all__ = [
    "DB_FILE", "GENESIS", "CheckpointRow", "Event", "EventLog", "EventRef", "Executor", "JournalBusy", "JournalError",
    "JournalPoller", "Lineage", "ReplayReport", "Replayer", "SessionRecorder", "SessionRow", "Step",
    "StepResult", "VerifyResult", "canonical", "event_hash", "plan", "pull_journal", "verify_events",
]
