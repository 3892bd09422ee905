"""Where the runtime mounts things into every sandbox, once: the host (keepstate.runtime.gvisor, the template
builder, the create request's checks) and the agent inside (keepstate.agent) read them from here.

    TEMPLATE_VIEW  the template's root, read-only: what a filesystem-only pause diffs against
    AGENT_RUNTIME  the agent runtime, read-only: the Python, libraries and tools the agent runs on
                   (docs/design/agent-runtime.md)
    AGENT_PACKAGE  the folder holding the `keepstate` package, bind-mounted read-only at AGENT_PACKAGE/keepstate
    VOLUMES_DIR    volume i of a sandbox is mounted at VOLUMES_DIR/i (i < VOLUME_SLOTS), which every template
                   build has; the agent bind-mounts it at the path asked for, read from VOLUME_MOUNTS_ENV

This module imports nothing, so the agent may import it too (like keepstate/ports.py).
"""

TEMPLATE_VIEW = "/opt/keepstate/template"
VOLUMES_DIR = "/opt/keepstate/volumes"
AGENT_RUNTIME = "/opt/keepstate/rt"
AGENT_PACKAGE = "/opt/keepstate/lib"
VOLUME_SLOTS = 16
VOLUME_MOUNTS_ENV = "KEEPSTATE_VOLUME_MOUNTS"

__all__ = ["AGENT_PACKAGE", "AGENT_RUNTIME", "TEMPLATE_VIEW", "VOLUME_MOUNTS_ENV", "VOLUME_SLOTS", "VOLUMES_DIR"]
