import sys

from keepstate.agent.mcp_gateway.cli import main

sys.exit(main())
