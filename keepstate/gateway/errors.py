"""Errors in the shape the caller's provider uses, so that unmodified SDKs raise their usual exceptions.

    GatewayError                      an answer the gateway gives itself, never an upstream one
     |- status, flavour-neutral type ("invalid_request", "authentication", "not_found", "rate_limit",
     |  "budget", "conflict", "unavailable", "database", "upstream", "timeout"), message
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# neutral type -> (OpenAI error type, OpenAI code, Anthropic error type)
_TYPES: dict[str, tuple[str, str | None, str]] = {
    "invalid_request": ("invalid_request_error", None, "invalid_request_error"),
    "authentication": ("invalid_request_error", "invalid_api_key", "authentication_error"),
    "not_found": ("invalid_request_error", "model_not_found", "not_found_error"),
    "budget": ("insufficient_quota", "insufficient_quota", "rate_limit_error"),
    "conflict": ("server_error", "call_in_progress", "api_error"),
    "unavailable": ("server_error", "sandbox_not_bound", "overloaded_error"),
    "database": ("server_error", "database_unavailable", "overloaded_error"),
    "upstream": ("server_error", "upstream_error", "api_error"),
    "timeout": ("server_error", "upstream_timeout", "api_error"),
    "internal": ("server_error", None, "api_error"),
}


@dataclass
class GatewayError(Exception):
    status: int
    kind: str
    message: str
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status} {self.kind}: {self.message}"

    def body(self, flavour: str) -> bytes:
        oa_type, code, an_type = _TYPES[self.kind]
        if flavour == "anthropic":
            doc: dict[str, object] = {"type": "error", "error": {"type": an_type, "message": self.message}}
        else:
            doc = {"error": {"message": self.message, "type": oa_type, "param": self.param, "code": code}}
        return json.dumps(doc).encode()


def invalid(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, "invalid_request", message, param)


def unauthenticated() -> GatewayError:
    return GatewayError(401, "authentication", "Invalid or missing KeepState gateway token.")


def unknown_model(model: str) -> GatewayError:
    return GatewayError(404, "not_found", f"The model `{model}` does not exist or you do not have access to it.",
                        "model")


def over_budget(scope: str, ident: str) -> GatewayError:
    return GatewayError(
        429,
        "budget",
        f"This call could exceed the budget of {scope} {ident}; it was not sent upstream.",
        headers={"x-should-retry": "false"},
    )


def in_progress_elsewhere() -> GatewayError:
    return GatewayError(409, "conflict", "This call is in progress in another gateway process or node; retry "
                        "shortly.")


def stopping() -> GatewayError:
    """The gateway stopped before the provider answered: the call stays in flight under this gateway's name, and is
    taken over by the gateway that its retry reaches once this one is gone."""
    return GatewayError(503, "unavailable", "The gateway stopped before the provider answered; retry.",
                        headers={"retry-after": "1", "x-should-retry": "true"})


def not_bound_yet(peer: str) -> GatewayError:
    # 503 and a retry-after: the SDKs retry it, and by then the sandbox instance is usually bound.
    return GatewayError(503, "unavailable", f"The sandbox at {peer} is not registered with the gateway yet; retry.",
                        headers={"retry-after": "1", "x-should-retry": "true"})


def database_unavailable(message: str) -> GatewayError:
    # As the server answers when its database is down (docs/design/database.md): 503, retry in 2 s. The SDKs retry it.
    return GatewayError(503, "database", message, headers={"retry-after": "2", "x-should-retry": "true"})


def upstream_unreachable(provider: str, detail: str) -> GatewayError:
    return GatewayError(502, "upstream", f"Provider {provider} could not be reached: {detail}")


def upstream_timeout(provider: str) -> GatewayError:
    return GatewayError(504, "timeout", f"Provider {provider} did not answer in time.")
