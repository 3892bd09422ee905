"""`python3 -m keepstate.agent [--host 0.0.0.0] [--port 49983] [--template /etc/keepstate/template.json]`"""

from __future__ import annotations

import argparse
import os
import sys

from keepstate.agent import DEFAULT_PORT
from keepstate.agent.settings import DEFAULT_TEMPLATE_PATH


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 -m keepstate.agent", description=__doc__)
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")  # noqa: S104
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 = any)")
    parser.add_argument(
        "--template",
        default=os.environ.get("KEEPSTATE_TEMPLATE", DEFAULT_TEMPLATE_PATH),
        help=f"template defaults file (default {DEFAULT_TEMPLATE_PATH}, or $KEEPSTATE_TEMPLATE)",
    )
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.umask(0o022)  # files we create for users get 0644 / 0755, like envd

    import uvicorn

    from keepstate.agent.app import AgentApp
    from keepstate.agent.settings import SandboxSettings, SettingsError, load_template

    try:
        template = load_template(args.template)
    except SettingsError as e:
        print(f"keepstate.agent: {e}", file=sys.stderr)
        return 2
    import importlib.util

    loop = os.environ.get("KEEPSTATE_AGENT_LOOP") or (
        "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio")
    config = uvicorn.Config(
        AgentApp(SandboxSettings(template)),
        host=args.host,
        port=args.port,
        loop=loop,
        http="httptools",
        ws="none",
        lifespan="on",
        log_level=args.log_level,
        access_log=False,
        server_header=False,
        date_header=False,
        timeout_keep_alive=120,  # the SDK keeps pooled connections for minutes; don't race it closing them
    )
    uvicorn.Server(config).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
