"""A replay executor that drives a live KeepState (or E2B) server with the stock `e2b` SDK."""

from __future__ import annotations

import shlex
from typing import Any


class E2BExecutor:
    """Runs replayed steps in one fresh sandbox of `template`; use as a context manager (kills the sandbox)."""

    def __init__(self, template: str | None, *, api_url: str | None = None, api_key: str | None = None,
                 sandbox_url: str | None = None, timeout: int = 600, step_timeout: float = 120.0,
                 extra: dict[str, Any] | None = None) -> None:
        from e2b import Sandbox  # imported here so the rest of keepstate.session never needs the SDK

        opts: dict[str, Any] = {k: v for k, v in {"api_url": api_url, "api_key": api_key,
                                                  "sandbox_url": sandbox_url or api_url}.items() if v}
        opts.update(extra or {})
        self.step_timeout = step_timeout
        self.sandbox = Sandbox.create(template=template, timeout=timeout,
                                      metadata={"keepstate.purpose": "replay"}, **opts)

    @property
    def sandbox_id(self) -> str:
        return str(self.sandbox.sandbox_id)

    def run(self, cmd: str, args: list[str], cwd: str | None, user: str | None, envs: dict[str, str]) -> int:
        from e2b import CommandExitException

        # the SDK takes one shell line; quoting keeps the recorded argv exact
        line = shlex.join([cmd, *args])
        try:
            result = self.sandbox.commands.run(line, envs=envs or None, user=user, cwd=cwd,
                                               timeout=self.step_timeout)
        except CommandExitException as exc:
            return int(exc.exit_code)
        return int(result.exit_code)

    def write(self, path: str, data: bytes, user: str | None) -> None:
        self.sandbox.files.write(path, data, user=user)

    def close(self) -> None:
        self.sandbox.kill()

    def __enter__(self) -> E2BExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
