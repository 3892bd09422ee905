"""Every TCP port KeepState uses, once.

Inside a sandbox (E2B's numbers: the stock SDKs address them through the router's E2b-Sandbox-Port header):
    AGENT_PORT        49983  the envd-compatible agent (keepstate.agent)
    INTERPRETER_PORT  49999  the code-interpreter bridge (keepstate.agent.interpreter)
    MCP_PORT          50005  the MCP gateway of the mcp-gateway template (keepstate.agent.mcp_gateway)
On the host:
    API_PORT          3000   `keepstate serve`'s default listener: control plane and data-plane router
    GATEWAY_PORT      3100   the model-call metering gateway (`keepstate gateway`, `keepstate serve --gateway-*`)

This module imports nothing, so the agent and the bridge inside a sandbox may import it too.
Template definitions are TOML and spell the bridge's port out; tests/template checks they agree.
"""

AGENT_PORT = 49983
INTERPRETER_PORT = 49999
MCP_PORT = 50005
API_PORT = 3000
GATEWAY_PORT = 3100

__all__ = ["AGENT_PORT", "API_PORT", "GATEWAY_PORT", "INTERPRETER_PORT", "MCP_PORT"]
