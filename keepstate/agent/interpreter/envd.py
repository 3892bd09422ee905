"""The sandbox's envd agent, as the bridge sees it: the access token and sandbox-level env vars.

The bridge holds no secret of its own. A request's `X-Access-Token` is valid exactly when envd
accepts it on `GET /envs`, which also returns the sandbox-level env vars that per-execution
`env_vars` revert to. Answers are cached per token.
"""

from __future__ import annotations

import asyncio

import aiohttp


class EnvdError(RuntimeError):
    """envd could not be asked (not running yet, or broken)."""


class Unauthorized(PermissionError):
    """envd rejected the request's access token."""


class Envd:
    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self._url = url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._accepted: tuple[str | None, dict[str, str]] | None = None
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def sandbox_envs(self, token: str | None) -> dict[str, str]:
        """The sandbox-level env vars; raises Unauthorized when envd rejects `token`."""
        async with self._lock:
            if self._accepted is not None and self._accepted[0] == token:
                return dict(self._accepted[1])
            envs = await self._fetch(token)
            self._accepted = (token, envs)
            return dict(envs)

    async def _fetch(self, token: str | None) -> dict[str, str]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        headers = {"X-Access-Token": token} if token else {}
        try:
            async with self._session.get(f"{self._url}/envs", headers=headers) as resp:
                if resp.status in (401, 403):
                    raise Unauthorized("unauthorized access, please provide a valid access token")
                if resp.status != 200:
                    raise EnvdError(f"envd GET /envs answered {resp.status}")
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise EnvdError(f"cannot reach envd at {self._url}: {exc}") from exc
        if not isinstance(body, dict):
            raise EnvdError("envd GET /envs did not return an object")
        return {str(k): str(v) for k, v in body.items()}
