"""The code-interpreter bridge: E2B's port-49999 API in front of Jupyter kernels.

Runs inside a `code-interpreter-v1` sandbox as `python3 -m keepstate.agent.interpreter --port 49999`
(root, Debian's Python). It may import only `keepstate.agent.interpreter.*`, `keepstate/__init__.py`
and the packages pinned in `templates/code-interpreter-v1.toml`.

Kernels are reached over ZeroMQ IPC sockets, never TCP, so that a gVisor checkpoint (which drops
TCP connections) keeps them reachable after restore.
"""

DEFAULT_PORT = 49999

__all__ = ["DEFAULT_PORT"]
