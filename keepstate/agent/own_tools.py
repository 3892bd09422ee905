"""The programs the agent starts for itself, taken from the agent runtime when it runs on one, so that an image
without them (busybox, distroless) or with a broken copy changes nothing (docs/design/agent-runtime.md).

A runtime program is started through the runtime's loader with the runtime's libraries; what it executes in turn
(the user's command, for setpriv) is the image's, started the usual way. Outside a runtime (the agent run on a
host in tests) the image's own copies are used, as before.
"""

from __future__ import annotations

import os
import sys

from keepstate.mountpoints import AGENT_RUNTIME

LOADER = "ld-linux-x86-64.so.2"
IMAGE_SETPRIV = "/usr/bin/setpriv"


def runtime_root() -> str | None:
    """The agent runtime this agent runs on (its python's prefix, holding the loader), or None."""
    prefix = sys.prefix
    if prefix == AGENT_RUNTIME and os.path.isfile(os.path.join(prefix, "lib", LOADER)):
        return prefix
    return None


def runtime_program(root: str, program: str) -> list[str]:
    """argv prefix running `program` (relative to the runtime) by the runtime's loader."""
    return [f"{root}/lib/{LOADER}", "--inhibit-cache", "--library-path", f"{root}/lib", f"{root}/{program}"]


def setpriv_command() -> list[str] | None:
    """How to run setpriv (the argv before its options), or None when there is none to run."""
    root = runtime_root()
    if root is not None and os.access(f"{root}/bin/setpriv", os.X_OK):
        return runtime_program(root, "bin/setpriv")
    if os.access(IMAGE_SETPRIV, os.X_OK):
        return [IMAGE_SETPRIV]
    return None
