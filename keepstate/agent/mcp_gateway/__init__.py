"""`mcp-gateway`: MCP servers as stdio subprocesses behind one Streamable-HTTP endpoint (docs/design/mcp-gateway.md).

Runs inside a sandbox of the `mcp-gateway` template, on that template's Python (the official `mcp` SDK is installed
there, not in the agent runtime): `config` reads E2B's `mcp` object, `gateway` serves, `cli` is the program."""
