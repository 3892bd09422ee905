"""One Jupyter kernel process and the bridge's connection to it.

A `Kernel` launches its process through jupyter_client over ZeroMQ *IPC* sockets (files in a
runtime directory), as the sandbox's unprivileged user, and routes every incoming message to
the request that caused it: one reader per channel, one queue per outstanding request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jupyter_client.manager import AsyncKernelManager

from keepstate.agent.interpreter.output import ExecutionOutput, Line

log = logging.getLogger(__name__)

# How long a kernel may take to answer its first kernel_info_request: tslab loads the TypeScript
# compiler, which has taken over a minute on 2 busy cores.
START_TIMEOUT = 180.0
ABORT_RETRIES = 3
# Seconds after an execution's idle status without its reply before it is finished anyway (and logged), or after
# its reply without the idle status before that is logged.
HALF_DONE_WAIT = 10.0
# Kernels that send a cell's visible values as display_data (see ExecutionOutput.displayed_values).
DISPLAYED_VALUES = {"ir"}


class KernelError(RuntimeError):
    """The kernel could not be started, or died."""


@dataclass(frozen=True)
class LaunchSpec:
    """Where and as whom kernels run."""

    runtime_dir: Path  # connection files and IPC sockets; must be writable by `user`
    cwd: str
    user: str | None  # None: the bridge's own user (tests on a host)
    env: Mapping[str, str]


def _user_env(spec: LaunchSpec) -> tuple[dict[str, str], dict[str, Any]]:
    """Environment and Popen arguments that make the kernel run as `spec.user`."""
    env = dict(spec.env)
    popen: dict[str, Any] = {}
    if spec.user is not None and spec.user != pwd.getpwuid(os.getuid()).pw_name:
        entry = pwd.getpwnam(spec.user)
        env.update(HOME=entry.pw_dir, USER=entry.pw_name, LOGNAME=entry.pw_name)
        popen = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    return env, popen


class _Manager(AsyncKernelManager):  # type: ignore[misc]  # jupyter_client ships no types
    """Hands the connection file to the kernel's user before launch (jupyter_client writes it 0600)."""

    kernel_uid: int | None = None

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
        if self.kernel_uid is not None and self.connection_file:
            os.chown(self.connection_file, self.kernel_uid, -1)
        await super()._async_launch_kernel(kernel_cmd, **kw)


class Kernel:
    def __init__(self, kernel_name: str, spec: LaunchSpec, arguments: list[str] | None = None) -> None:
        self.kernel_name = kernel_name
        self._spec = spec
        self._arguments = list(arguments or [])
        self._km: _Manager | None = None
        self._kc: Any = None
        self._readers: list[asyncio.Task[None]] = []
        self._waiting: dict[str, bool] = {}  # by channel: a message was waiting at the last _unstick
        self._waiters: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        # Bumped by every restart, so an execution waiting on the old process stops waiting.
        self.generation = 0

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        env, popen = _user_env(self._spec)
        self._km = _Manager(kernel_name=self.kernel_name, transport="ipc")
        self._km.connection_file = str(self._spec.runtime_dir / f"kernel-{os.urandom(6).hex()}.json")
        if popen:
            self._km.kernel_uid = popen["user"]
        try:
            try:
                await self._km.start_kernel(cwd=self._spec.cwd, env=env, extra_arguments=self._arguments,
                                            **popen)
            except Exception as exc:
                raise KernelError(f"cannot start kernel '{self.kernel_name}': {exc}") from exc
            self._kc = self._km.client()
            self._kc.start_channels(shell=True, iopub=True, stdin=False, hb=False, control=False)
            self._readers = [self._reader("iopub"), self._reader("shell")]
            await self._wait_ready()
        except BaseException:
            # Failed or cancelled (bridge stopping) half-way: leave no orphan kernel process behind.
            await asyncio.shield(self.shutdown())
            raise

    async def restart(self) -> None:
        """A fresh process on the same IPC sockets; the bridge's sockets reconnect by themselves."""
        assert self._km is not None
        self.generation += 1
        await self._km.restart_kernel(now=True)
        await self._wait_ready()

    async def shutdown(self) -> None:
        for task in self._readers:
            task.cancel()
        self._readers = []
        if self._kc is not None:
            self._kc.stop_channels()
            self._kc = None
        if self._km is not None:
            try:
                await self._km.shutdown_kernel(now=True)
            except Exception:  # already dead: nothing left to stop
                log.debug("kernel shutdown failed", exc_info=True)
            self._km = None

    async def interrupt(self) -> None:
        if self._km is not None:
            await self._km.interrupt_kernel()

    async def is_alive(self) -> bool:
        return self._km is not None and bool(await self._km.is_alive())

    # -- messaging -----------------------------------------------------------------------------

    def _reader(self, name: str) -> asyncio.Task[None]:
        channel = getattr(self._kc, f"{name}_channel")
        return asyncio.create_task(self._read(channel), name=f"{self.kernel_name}-{name}")

    async def _unstick(self) -> None:
        """Restart a channel's reader if a message waits on its socket that the reader has not taken.

        A reader blocks in zmq.asyncio's poll until the socket's file descriptor signals; a wakeup that is missed
        leaves it blocked with messages queued (suspected behind two hangs seen in CI: a kernel that 'did not
        answer' its start-up request for 180 s, and an execute_reply that never reached the shell reader). Asked
        once a second while a start-up or an execution waits; a message seen waiting twice in a row (a second
        apart: a reader that works takes one within milliseconds) means the reader is stuck in its poll, where
        cancelling it loses nothing. A missed wakeup then costs two seconds, and is logged.
        """
        if self._kc is None:
            return
        for i, name in enumerate(("iopub", "shell")):
            channel = getattr(self._kc, f"{name}_channel")
            try:
                waiting = bool(await channel.socket.poll(timeout=0))
            except Exception:  # a closed socket: the kernel is going away, nothing to unstick
                return
            seen_before, self._waiting[name] = self._waiting.get(name, False), waiting
            if waiting and seen_before:
                self._waiting[name] = False
                log.warning("kernel '%s': a message waits on its %s channel that the reader has not taken; "
                            "restarting the reader", self.kernel_name, name)
                self._readers[i].cancel()
                self._readers[i] = self._reader(name)

    async def _read(self, channel: Any) -> None:
        while True:
            try:
                msg = await channel.get_msg()
            except asyncio.CancelledError:
                raise
            except Exception:  # a malformed or unsigned message: drop it, keep reading
                log.warning("dropping unreadable kernel message", exc_info=True)
                continue
            parent = (msg.get("parent_header") or {}).get("msg_id")
            queue = self._waiters.get(parent) if parent else None
            if queue is not None:
                queue.put_nowait(msg)

    async def _wait_ready(self) -> None:
        """Until a kernel_info round trip is seen on shell *and* iopub (iopub subscriptions lag).

        A request is sent every second until one is answered on both channels. Every request stays awaited until
        the end: a kernel starved of CPU may answer each one more than a second late, and answers that only ever
        matched the newest request would then never count.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT
        answers: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        sent: list[str] = []
        replied: set[str] = set()
        published: set[str] = set()
        try:
            while loop.time() < deadline:
                msg_id = self._kc.kernel_info()
                sent.append(msg_id)
                self._waiters[msg_id] = answers
                end = min(deadline, loop.time() + 1.0)
                while loop.time() < end:
                    try:
                        msg = await asyncio.wait_for(answers.get(), end - loop.time())
                    except TimeoutError:
                        break
                    parent = msg["parent_header"]["msg_id"]
                    (replied if msg["msg_type"] == "kernel_info_reply" else published).add(parent)
                    if replied & published:
                        return
                if self._km is not None and not await self._km.is_alive():
                    raise KernelError(f"kernel '{self.kernel_name}' exited during start-up")
                await self._unstick()
        finally:
            for msg_id in sent:
                self._waiters.pop(msg_id, None)
        raise KernelError(f"kernel '{self.kernel_name}' did not answer within {START_TIMEOUT:.0f} s")

    async def execute(self, code: str, *, silent: bool = False) -> AsyncIterator[Line]:
        """Run `code`; yield the output lines (none when silent) until the kernel is done with it."""
        for attempt in range(ABORT_RETRIES + 1):
            output = ExecutionOutput(silent=silent, displayed_values=self.kernel_name in DISPLAYED_VALUES)
            async for line in self._execute_once(code, output):
                yield line
            if not output.aborted:
                return
            # Refused unrun (no line was produced): tslab aborts requests for 200 ms after an error.
            await asyncio.sleep(0.25 * (attempt + 1))
        raise KernelError(f"kernel '{self.kernel_name}' kept aborting the execution")

    async def _execute_once(self, code: str, output: ExecutionOutput) -> AsyncIterator[Line]:
        if self._kc is None:
            raise KernelError("kernel is not running")
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        silent = output.silent
        msg_id = self._kc.execute(code, silent=silent, store_history=not silent, allow_stdin=False)
        self._waiters[msg_id] = queue
        generation = self.generation
        half_done_since: float | None = None  # when the reply or the idle status came, and the other not yet
        try:
            while not output.done:
                try:
                    msg = await asyncio.wait_for(queue.get(), 1.0)
                except TimeoutError:
                    if generation != self.generation:
                        raise KernelError(f"kernel '{self.kernel_name}' was restarted during execution") from None
                    if not await self.is_alive():
                        raise KernelError(f"kernel '{self.kernel_name}' died during execution") from None
                    await self._unstick()
                    if (output.idle or output.reply is not None) and half_done_since is None:
                        half_done_since = time.monotonic()
                    elif half_done_since is not None and time.monotonic() - half_done_since > HALF_DONE_WAIT:
                        if output.idle:
                            # Every output message comes before the idle status; only the reply is missing (seen
                            # with bash_kernel in CI). Finish rather than hold the caller until its timeout.
                            log.warning("execution %s on kernel '%s': idle for %.0f s and no execute_reply; "
                                        "finishing it without one", msg_id, self.kernel_name, HALF_DONE_WAIT)
                            for line in output.pending():
                                yield line
                            return
                        # Replied, not idle: output may still come. Evidence for the log, once.
                        log.warning("execution %s on kernel '%s': replied %.0f s ago, still waiting for idle",
                                    msg_id, self.kernel_name, HALF_DONE_WAIT)
                        half_done_since = float("inf")
                    continue
                for line in output.feed(msg):
                    yield line
        finally:
            self._waiters.pop(msg_id, None)
