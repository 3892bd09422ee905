"""The metering gateway: model calls recorded once, recovered after interruptions, billed at most once.

Design and guarantees: docs/design/gateway.md.
"""

from keepstate.gateway.config import ConfigError, GatewayConfig, ProviderConfig
from keepstate.gateway.gateway import Gateway
from keepstate.gateway.server import GATEWAY, create_app

__all__ = ["GATEWAY", "ConfigError", "Gateway", "GatewayConfig", "ProviderConfig", "create_app"]
