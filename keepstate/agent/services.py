"""Template services (e.g. the code interpreter): started with the agent, restarted with backoff when they die.

Each service's stdout and stderr go to `<log dir>/<name>.log` inside the sandbox (default /var/log/keepstate, or
$KEEPSTATE_SERVICE_LOG_DIR), so that they can be read through the SDK like any file, and survive the service's
restarts. At each start a log over LOG_ROTATE_BYTES becomes `<name>.log.1`, replacing the previous one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time

from keepstate.agent.reaper import REAPER, ChildReaper
from keepstate.agent.settings import SandboxSettings, ServiceSpec
from keepstate.agent.users import UnknownUser, lookup_user, process_env

log = logging.getLogger("keepstate.agent.services")

INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 30.0  # a run this long resets the backoff
LOG_DIR_ENV = "KEEPSTATE_SERVICE_LOG_DIR"
DEFAULT_LOG_DIR = "/var/log/keepstate"
LOG_ROTATE_BYTES = 8 << 20


def open_log(name: str) -> int | None:
    """A descriptor of the service's log file, opened for appending; None (inherit ours) if it cannot be."""
    folder = os.environ.get(LOG_DIR_ENV) or DEFAULT_LOG_DIR
    path = os.path.join(folder, f"{name}.log")
    try:
        os.makedirs(folder, mode=0o755, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_size >= LOG_ROTATE_BYTES:
                os.replace(path, path + ".1")
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
    except OSError as e:
        log.warning("service %s: no log file at %s (%s); its output goes to the agent's", name, path, e)
        return None


def next_backoff(previous: float, ran_for: float) -> float:
    if ran_for >= STABLE_AFTER_S:
        return INITIAL_BACKOFF_S
    return min(max(previous * 2, INITIAL_BACKOFF_S), MAX_BACKOFF_S)


class Supervisor:
    def __init__(self, settings: SandboxSettings, reaper: ChildReaper = REAPER) -> None:
        self._settings = settings
        self._reaper = reaper
        self._tasks: list[asyncio.Task[None]] = []
        self._pids: dict[str, int] = {}
        self.restarts: dict[str, int] = {}

    def start(self) -> None:
        for spec in self._settings.template.services:
            self._tasks.append(asyncio.get_running_loop().create_task(self._keep_alive(spec)))

    def _spawn(self, spec: ServiceSpec) -> tuple[int, asyncio.Future[int]]:
        user = lookup_user(spec.user)
        env = process_env(user, self._settings.env_vars, spec.env)
        identity: dict[str, object] = {}
        if os.geteuid() == 0:
            identity = {"user": user.uid, "group": user.gid, "extra_groups": os.getgrouplist(user.name, user.gid)}
        cwd = user.home if os.path.isdir(user.home) else "/"
        out = open_log(spec.name)
        try:
            popen = subprocess.Popen(  # noqa: S603 - commands come from the template
                spec.command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT if out else None,
                cwd=cwd, env=env, umask=0o022, start_new_session=True, close_fds=True,
                **identity,  # type: ignore[call-overload]
            )
        finally:
            if out is not None:
                os.close(out)
        exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_exit(status: int) -> None:
            popen.returncode = os.waitstatus_to_exitcode(status)
            if not exited.done():
                exited.set_result(status)

        self._reaper.watch(popen.pid, on_exit)
        return popen.pid, exited

    async def _keep_alive(self, spec: ServiceSpec) -> None:
        backoff = INITIAL_BACKOFF_S
        while True:
            started = time.monotonic()
            try:
                pid, exited = self._spawn(spec)
            except (OSError, UnknownUser) as e:
                log.error("service %s: cannot start: %s", spec.name, e)
            else:
                self._pids[spec.name] = pid
                status = await exited
                self._pids.pop(spec.name, None)
                log.warning("service %s exited (status %s); restarting", spec.name, status)
            backoff = next_backoff(backoff, time.monotonic() - started)
            self.restarts[spec.name] = self.restarts.get(spec.name, 0) + 1
            await asyncio.sleep(backoff)

    def pid(self, name: str) -> int | None:
        return self._pids.get(name)

    def pids(self) -> set[int]:
        return set(self._pids.values())

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for pid in self._pids.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
        self._tasks.clear()
