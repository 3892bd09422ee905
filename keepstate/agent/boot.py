"""The agent's first Python in a sandbox: run by the agent runtime's python3 with `-I -S`
(docs/design/agent-runtime.md), it gives `sys.path` exactly the agent's package, the runtime's pinned
dependencies and its standard library, nothing of the image, then runs the agent.

`-I` already keeps out PYTHON* variables, the user site and the script's folder, and `-S` the image's
site-packages, `.pth` files and sitecustomize; what is left to check is that Python found its prefix in the
runtime (its landmark, lib/python3.11/os.py, beside its binary), and not in the image's /usr.
Standard library only until the path is set.
"""

import os
import sys

PACKAGE = "/opt/keepstate/lib"  # keepstate.mountpoints.AGENT_PACKAGE, not importable yet


def agent_path(prefix: str, package: str = PACKAGE) -> list[str]:
    """The package, then the runtime's site folder, then the stdlib entries Python found under the prefix."""
    inside = [p for p in sys.path if p == prefix or p.startswith(prefix.rstrip("/") + "/")]
    return [package, os.path.join(prefix, "site"), *inside]


def main() -> int:
    prefix = sys.prefix
    here = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable or "")))
    if not os.path.isfile(os.path.join(prefix, "lib", "python3.11", "os.py")) or (here and here != prefix):
        print(f"keepstate.agent: the runtime's python found its prefix at {prefix!r}, not in the agent runtime "
              f"({here!r}); refusing to run on the image's Python", file=sys.stderr)
        return 70
    sys.path[:] = agent_path(prefix)
    if sys.argv[1:] == ["export-files"]:  # the host's runtime, when the agent may not answer (files_archive.py)
        from keepstate.agent.files_archive import export_stdout

        return export_stdout()
    from keepstate.agent.__main__ import main as agent_main

    return agent_main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
