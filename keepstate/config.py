"""Where KeepState keeps its data, and the settings every component shares."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """The data directory: $KEEPSTATE_HOME, default /var/lib/keepstate."""
    return Path(os.environ.get("KEEPSTATE_HOME", "/var/lib/keepstate"))


# A sandbox's disk (its writable layer) when its template names none: E2B's smallest plan.
DEFAULT_DISK_MB = 10240
