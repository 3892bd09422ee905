"""Stdio MCP servers for tests of the MCP gateway (keepstate.agent.mcp_gateway), deterministic, on the official SDK.

    python -m keepstate.testing.mcp_servers NAME [TOOL,TOOL...]

Tools (all, or those named): `echo(text)` ("NAME: text"), `add(a, b)`, `count()` (calls so far: state a pause must
keep), `exit_now()` (the process ends without answering: the gateway must start it again)."""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> None:
    from mcp.server.mcpserver import MCPServer

    args = argv if argv is not None else sys.argv[1:]
    name = args[0] if args else "test"
    only = set(args[1].split(",")) if len(args) > 1 else None
    server: MCPServer = MCPServer(name)
    calls = [0]

    @server.tool()
    def echo(text: str) -> str:
        """Say `text` back, after this server's name."""
        calls[0] += 1
        return f"{name}: {text}"

    @server.tool()
    def add(a: int, b: int) -> int:
        """a + b."""
        calls[0] += 1
        return a + b

    @server.tool()
    def count() -> int:
        """How many calls this process has answered."""
        calls[0] += 1
        return calls[0]

    @server.tool()
    def exit_now() -> str:
        """End this process without an answer."""
        os._exit(3)

    if only is not None:
        for tool in {"echo", "add", "count", "exit_now"} - only:
            server.remove_tool(tool)
    server.run("stdio")


if __name__ == "__main__":
    main()
