"""The in-sandbox agent: an envd-compatible process and filesystem service (port 49983).

Runs inside every sandbox as `python3 -m keepstate.agent`. It may import only `keepstate.agent.*`,
`keepstate/__init__.py`, `keepstate/ports.py`, `keepstate/mountpoints.py` and the packages pinned in
`requirements.txt` (the sandbox has nothing else).
"""

from keepstate.ports import AGENT_PORT

# The highest envd version whose features (§3.8 of the protocol notes) this agent fully implements:
# recursive watch, stdin=false, server-side default user, CloseStdin, octet-stream uploads, file metadata,
# include_entry and allow_network_mounts. The host returns it as `envdVersion`.
ENVD_VERSION = "0.6.13"

DEFAULT_PORT = AGENT_PORT

__all__ = ["DEFAULT_PORT", "ENVD_VERSION"]
