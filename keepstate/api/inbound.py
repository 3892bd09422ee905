"""What the router decides about traffic to a sandbox's port URL before it relays it (docs/design/network.md,
"Inbound"): the traffic token, the Host the sandbox sees, HTTP or HTTPS inside, and waking a paused sandbox.

E2B's rules, from the sandbox's create-time `network` and `lifecycle`:
- `allowPublicTraffic: false`: port traffic (any port but the agent's, which has its own access token) must carry
  `e2b-traffic-access-token: <trafficAccessToken>`, else a 403; the header stops at the router.
- `maskRequestHost` (`${PORT}` is replaced): the Host header the sandbox's server sees, instead of the sandbox's
  address.
- `httpsPorts`: the server inside talks TLS on those ports; the router connects with TLS, unverified (a sandbox's
  certificate is its own, usually self-signed).
- `autoResume`: a request for a paused sandbox resumes it (the manager's connect: under the sandbox's lock, with
  its create-time timeout), then is relayed; concurrent requests share one resume.
"""

from __future__ import annotations

import hmac
import logging

from aiohttp import web

from keepstate.egress.policy import Policy
from keepstate.errors import KeepStateError, NotFound
from keepstate.ports import AGENT_PORT
from keepstate.sandbox.manager import SandboxManager
from keepstate.sandbox.record import SandboxRow
from keepstate.sandbox.state import State

from .control import error_response

log = logging.getLogger("keepstate.router")
TOKEN_HEADER = "e2b-traffic-access-token"
PORT_VAR = "${PORT}"
# States a request may wake a sandbox from: paused, or on its way to or from it (the resume waits for the
# sandbox's lock: a request that arrives mid-pause resumes it once the pause has finished, and one that arrives
# while a connect resumes it waits for that).
WAKEABLE = (State.PAUSED, State.PAUSING, State.RESUMING)
_CACHE = 4096


def forbidden(sandbox_id: str) -> web.Response:
    return web.json_response(
        {"code": 403, "message": f"sandbox {sandbox_id} does not allow public traffic: send its trafficAccessToken "
                                 f"in the `{TOKEN_HEADER}` header"}, status=403)


def paused(sandbox_id: str) -> web.Response:
    """A paused sandbox without autoResume: E2B's 502 (its message says "was not found", which the SDK reads as a
    sandbox that is not running)."""
    return web.json_response(
        {"sandboxId": sandbox_id, "code": 502,
         "message": "The sandbox was not found: it is paused (resume it with Sandbox.connect, or create it with "
                    "lifecycle auto_resume to have its traffic resume it)"}, status=502)


class Inbound:
    def __init__(self, manager: SandboxManager) -> None:
        self.manager = manager
        self._policies: dict[str, tuple[dict[str, object], Policy]] = {}

    def policy(self, row: SandboxRow) -> Policy:
        """The sandbox's policy, parsed once per stored policy (a network update stores a new dict)."""
        hit = self._policies.get(row.sandbox_id)
        if hit is not None and hit[0] is row.settings.network:
            return hit[1]
        if len(self._policies) >= _CACHE:
            self._policies.clear()
        policy = Policy.from_json(row.settings.network)
        self._policies[row.sandbox_id] = (row.settings.network, policy)
        return policy

    def refuse(self, request: web.Request, row: SandboxRow, port: int) -> web.Response | None:
        """A 403 for port traffic without the sandbox's traffic token, when it has one; None to let it pass."""
        token = row.settings.traffic_token
        if port == AGENT_PORT or token is None:
            return None
        given = request.headers.get(TOKEN_HEADER, "")
        if hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode()):
            return None
        return forbidden(row.sandbox_id)

    def upstream(self, row: SandboxRow, port: int) -> tuple[str, str | None]:
        """(scheme, Host header or None for the sandbox's address) of the relay to `port`."""
        if port == AGENT_PORT:
            return "http", None
        policy = self.policy(row)
        scheme = "https" if port in policy.https_ports else "http"
        mask = policy.mask_request_host
        return scheme, mask.replace(PORT_VAR, str(port)) if mask is not None else None

    async def wake(self, sandbox_id: str) -> web.Response | None:
        """Resume a paused sandbox with autoResume for the request that found it so; None when it runs now (the
        caller routes again), else the answer to give. Concurrent callers wait on one resume."""
        row = self.manager.table.find(sandbox_id)
        if row is None or row.state not in WAKEABLE:
            return None
        if not row.settings.auto_resume:
            return paused(sandbox_id)
        try:
            await self.manager.wake(row)
        except NotFound:  # killed meanwhile: the router's own "not found"
            return None
        except KeepStateError as exc:  # refused (a limit, a start queue full): say so, as the API would
            return error_response(exc)
        except Exception as exc:
            return web.json_response({"sandboxId": sandbox_id, "code": 502,
                                      "message": f"The sandbox could not be resumed: {exc}"}, status=502)
        return None
