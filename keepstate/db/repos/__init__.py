"""One repository per aggregate (docs/design/database.md, "Repositories, and what each promises"): each method is one
transaction on the Database it was given, async, and takes and returns the plain records of keepstate.db.records.

    db = await Database.open(url)
    sandboxes = Sandboxes(db)
    version = await sandboxes.transition("sb1", expect_version=3, expect_epoch=0, state="paused")
"""

from keepstate.db.repos.history import History
from keepstate.db.repos.keys import Keys
from keepstate.db.repos.leases import Leases
from keepstate.db.repos.ledger import Ledger
from keepstate.db.repos.nodes import Nodes
from keepstate.db.repos.sandboxes import Sandboxes
from keepstate.db.repos.secrets import Secrets
from keepstate.db.repos.snapshots import Snapshots
from keepstate.db.repos.templates import Templates
from keepstate.db.repos.volumes import Volumes

__all__ = ["History", "Keys", "Leases", "Ledger", "Nodes", "Sandboxes", "Secrets", "Snapshots", "Templates", "Volumes"]
