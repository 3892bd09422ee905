"""A sandbox's side of the metering gateway: its environment, and one gateway run per instance.

Processes keep the token they were started with (it lives in their memory), so after a restore or fork the
gateway tells runs apart by the instance's address: every new instance gets a new run bound to its address,
before its agent can call the gateway.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .record import SandboxRow

if TYPE_CHECKING:
    from keepstate.gateway.gateway import Gateway

log = logging.getLogger("keepstate.sandbox")


class GatewayRuns:
    def __init__(self, gateway: Gateway | None, url: str | None) -> None:
        self.gateway = gateway
        self.url = url

    async def env(self, row: SandboxRow) -> dict[str, str]:
        """Template env, then the metering gateway's variables, then the create request's own."""
        s = row.settings
        env = dict(s.template_env)
        if self.gateway is not None and self.url and s.gateway:
            token = s.gateway_token or await self.register(row)
            env.update(self.gateway.sandbox_env(token, self.url))
        env.update(s.env_vars)
        return env

    def metered(self, row: SandboxRow) -> bool:
        return self.gateway is not None and bool(row.settings.gateway_token)

    async def register(self, row: SandboxRow, parent_session: str | None = None) -> str:
        """A new gateway run for the row's current instance, bound to its address; recorded in the row."""
        assert self.gateway is not None
        token = await self.gateway.register_run(row.session_id, row.sandbox_id, row.api_key_id,
                                                row.settings.checkpoint_id, parent_session_id=parent_session,
                                                source_ip=row.address)
        row.settings.gateway_token = token
        return token

    async def rebind(self, row: SandboxRow, parent_session: str | None = None) -> None:
        """A new instance of a metered sandbox (resume, fork): a new run for its address."""
        if self.gateway is not None and row.settings.gateway_token:
            await self.register(row, parent_session)

    async def end(self, row: SandboxRow) -> None:
        if self.gateway is not None and row.settings.gateway_token:
            await self.gateway.end_run(row.settings.gateway_token)

    async def mark_checkpoint(self, row: SandboxRow, checkpoint_id: str, frozen_from: float,
                              frozen_until: float) -> None:
        if not self.metered(row):
            return
        assert self.gateway is not None
        try:
            await self.gateway.mark_checkpoint(row.session_id, checkpoint_id, frozen_from, frozen_until)
        except LookupError as exc:  # no active run: nothing to mark, say so
            log.warning("gateway mark for checkpoint %s: %s", checkpoint_id, exc)
