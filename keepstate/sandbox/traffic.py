"""The traffic access token of a sandbox whose port URLs are not public (E2B's `allowPublicTraffic: false`).

A new one for every sandbox that asks (a create, a fork, a sandbox made from a snapshot): holding a sandbox's
token opens its ports and no other's. The router checks it (api/inbound.py).
"""

from __future__ import annotations

import secrets
from typing import Any

from keepstate.egress.policy import Policy


def traffic_token(network: dict[str, Any]) -> str | None:
    """A fresh token when the stored policy (`Settings.network`) keeps port traffic private, else None."""
    if Policy.from_json(network).allow_public_traffic:
        return None
    return secrets.token_urlsafe(24)
