"""Fault points for crash tests: `point(name)` kills this process with SIGKILL, as `kill -9` would, when `name` is
in $KEEPSTATE_FAULTS (comma-separated). Nothing else ever sets it; a server started without it never stops here.

    faults.point("create-recorded")   # tests/durability: the crash between recording a create and answering it
"""

from __future__ import annotations

import os
import signal

ENV = "KEEPSTATE_FAULTS"


def point(name: str) -> None:
    if name in os.environ.get(ENV, "").split(","):
        os.kill(os.getpid(), signal.SIGKILL)
