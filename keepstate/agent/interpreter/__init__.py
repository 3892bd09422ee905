"""The code-interpreter bridge: E2B's port-49999 API in front of Jupyter kernels.

Runs inside a `code-interpreter-v1` sandbox as `python3 -m keepstate.agent.interpreter --port 49999`
(root, Debian's Python). It may import only `keepstate.agent.interpreter.*`, `keepstate/__init__.py`,
`keepstate/ports.py` and the packages pinned in `keepstate/template/definitions/code-interpreter-v1.toml`.

Kernels are reached over ZeroMQ IPC sockets, never TCP, so that a gVisor checkpoint (which drops
TCP connections) keeps them reachable after restore.
"""

from keepstate.ports import INTERPRETER_PORT

DEFAULT_PORT = INTERPRETER_PORT

__all__ = ["DEFAULT_PORT"]
