"""Where the runtime mounts things into every sandbox, once: the host (keepstate.runtime.gvisor, the template
builder, the create request's checks) and the agent inside (keepstate.agent) read them from here.

    TEMPLATE_VIEW  the template's root, read-only: what a filesystem-only pause diffs against
    VOLUMES_DIR    volume i of a sandbox is mounted at VOLUMES_DIR/i (i < VOLUME_SLOTS), which every template
                   build has; the agent bind-mounts it at the path asked for, read from VOLUME_MOUNTS_ENV

This module imports nothing, so the agent may import it too (like keepstate/ports.py).
"""

TEMPLATE_VIEW = "/opt/keepstate/template"
VOLUMES_DIR = "/opt/keepstate/volumes"
VOLUME_SLOTS = 16
VOLUME_MOUNTS_ENV = "KEEPSTATE_VOLUME_MOUNTS"

__all__ = ["TEMPLATE_VIEW", "VOLUME_MOUNTS_ENV", "VOLUME_SLOTS", "VOLUMES_DIR"]
