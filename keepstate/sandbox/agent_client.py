"""The one way into a sandbox's agent, for every caller: the lifecycle (health, /init), the metrics sampler, the
journal poller and the data-plane router. It owns the checkpoint quiesce gate.

The rule it enforces: **no TCP connection may be open into a sandbox while it is checkpointed** (an established
connection in gVisor's netstack at checkpoint time wedges the agent after a restore, runsc 20240729). So:

- host calls (`health`, `init`, `metrics`, `journal`, files, a template build's commands and uploads) use
  connections that are closed after each call (no keep-alive), and are counted while in flight;
- the router's proxied requests use one keep-alive pool per sandbox (`proxy_pool`, upstream.py; WebSockets an
  aiohttp session per sandbox, `proxy_session`) and register each in-flight request (`proxying`);
- `quiesce(sandbox_id, hold)` closes the gate: host calls raise `Quiesced`; router requests wait (hold=True, the
  sandbox runs on: a snapshot or fork) or are answered 502 by the router (a pause: the sandbox is no longer
  RUNNING); it waits for host calls in flight, cuts the router's in-flight requests (a snapshot's gate cuts a
  resumable stream on the sandbox's side only: docs/design/resumable-streams.md) and closes its pools (every
  connection, idle or in use), waits until the sandbox has answered the closes (the host's TCP table holds
  nothing to it but closed connections, at most SETTLE_MAX seconds; tcp_table.py says why), and only then
  yields. The gate opens again when the block ends. A kill (`abort`) cuts and closes the same way.

A fourth caller that went around this class would break checkpoints; none may.

It is also the idle freezer's door (idle.py, docs/design/idle.md): `waker(sandbox_id)` is called synchronously
at the start of every call, proxied request and quiesce, before any connection is made, and thaws a frozen
sandbox; a poll (the journal poller's pulls, the metrics sampler's, the freezer's own looks) does not wake one
(`asleep(sandbox_id)`: it raises Quiesced instead) and is not activity. `last_active` and `busy` are what the
freezer reads: when a call or proxied request last started or ended, and whether one is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from keepstate.ports import AGENT_PORT
from keepstate.runtime.base import RuntimeFailure

from . import agent_exec
from .tcp_table import settled
from .upstream import SandboxConnections

log = logging.getLogger("keepstate.sandbox")
SETTLE = 0.05  # after closing connections, before a checkpoint: how often the host's TCP table is read again
SETTLE_MAX = 2.0  # how long the sandbox may take to answer those closes before the checkpoint goes ahead
HOST_CALL_TIMEOUT = aiohttp.ClientTimeout(total=30)
FILES_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=120)  # a pause's files: any size
HEALTH_TIMEOUT = 3.0  # a pause asks the agent once; one that does not answer in this long is unresponsive


class Quiesced(Exception):
    """The sandbox is being checkpointed: no host call into it may start now."""


def agent_url(address: str, port: int = AGENT_PORT) -> str:
    return f"http://{address}:{port}"


@dataclass(eq=False)  # hashed by identity: one per request
class InFlight:
    """A proxied request: cut on quiesce or kill. Until its response has started, the router answers it with a
    JSON 502 instead of cutting the client's connection."""

    transport: asyncio.BaseTransport | None
    started: bool = False
    cut: bool = False
    resumable: bool = False  # the agent keeps its answer for the router to pick up (docs/design/resumable-streams.md)
    held: bool = False  # cut by a snapshot's gate (the sandbox runs on): the router may go on once it opens
    resume: bool = False  # held and resumable: its client's connection stays open, the router resumes it


class AgentClient:
    def __init__(self) -> None:
        self._http: aiohttp.ClientSession | None = None
        self._calls: Counter[str] = Counter()  # host calls in flight, by sandbox
        self._idle = asyncio.Condition()
        self._closed: dict[str, asyncio.Event] = {}  # quiesced sandboxes; set when the gate opens again
        self._hold: set[str] = set()  # quiesced sandboxes whose router requests wait
        self._proxy: dict[str, aiohttp.ClientSession] = {}  # WebSockets
        self._pools: dict[str, SandboxConnections] = {}  # HTTP
        self._inflight: dict[str, set[InFlight]] = {}
        self._active: dict[str, float] = {}  # monotonic time a counted call last started or ended, by sandbox
        self._busy: Counter[str] = Counter()  # counted calls and proxied requests in flight, by sandbox
        self.waker: Callable[[str], None] | None = None  # thaws a frozen sandbox (the idle freezer's)
        self.asleep: Callable[[str], bool] | None = None  # whether a sandbox is frozen

    async def start(self) -> None:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=HOST_CALL_TIMEOUT,
                                               connector=aiohttp.TCPConnector(limit=0, force_close=True))

    async def close(self) -> None:
        for sid in set(self._proxy) | set(self._pools):
            session = self._drop(sid)
            if session is not None:
                await session.close()
        if self._http is not None:
            await self._http.close()
            self._http = None

    # -- the gate ------------------------------------------------------------------------------------------------
    def quiesced(self, sandbox_id: str) -> bool:
        return sandbox_id in self._closed

    @contextlib.asynccontextmanager
    async def quiesce(self, sandbox_id: str, hold: bool, address: str = "") -> AsyncIterator[None]:
        if sandbox_id in self._closed:
            raise RuntimeError(f"sandbox {sandbox_id} is already quiesced")  # the lifecycle lock prevents this
        self.wake(sandbox_id)  # a frozen sandbox can neither be checkpointed nor close a connection
        self._closed[sandbox_id] = asyncio.Event()
        if hold:
            self._hold.add(sandbox_id)
        try:
            async with self._idle:
                await self._idle.wait_for(lambda: not self._calls[sandbox_id])
            session = self._drop(sandbox_id, keep_resumable=hold)  # closes the pool
            if session is not None:
                await session.close()
            if not address:
                await asyncio.sleep(SETTLE)
            else:
                left = await settled(address, SETTLE_MAX, SETTLE)
                if left:
                    log.warning("sandbox %s is checkpointed with TCP connections from the host still open (states "
                                "%s after %.0f s)", sandbox_id, left, SETTLE_MAX)
            yield
        finally:
            self._hold.discard(sandbox_id)
            self._closed.pop(sandbox_id).set()

    # -- activity (the idle freezer's) ------------------------------------------------------------------------------
    def wake(self, sandbox_id: str) -> None:
        if self.waker is not None:
            self.waker(sandbox_id)

    def last_active(self, sandbox_id: str) -> float:
        """The monotonic time a call or proxied request into the sandbox last started or ended; 0 if none did."""
        return self._active.get(sandbox_id, 0.0)

    def started(self, sandbox_id: str) -> None:
        """A sandbox handed out now counts as active now: the idle freezer leaves it alone for its first `after`
        seconds, not only from its first call (a claimed warm sandbox may get none before its create answers)."""
        self._active[sandbox_id] = time.monotonic()

    def busy(self, sandbox_id: str) -> bool:
        """Whether a call or proxied request (not a poll) is in flight into the sandbox."""
        return bool(self._busy[sandbox_id])

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: drop what activity tracking held for it."""
        self._active.pop(sandbox_id, None)

    def in_use(self, sandbox_id: str) -> contextlib.AbstractContextManager[None]:
        """Count a span of work as activity (a template build's steps, which talk to the agent directly): the
        idle freezer leaves the sandbox alone throughout."""
        return self._activity(sandbox_id)

    @contextlib.contextmanager
    def _activity(self, sandbox_id: str) -> Iterator[None]:
        self.wake(sandbox_id)
        self._busy[sandbox_id] += 1
        self._active[sandbox_id] = time.monotonic()
        try:
            yield
        finally:
            self._active[sandbox_id] = time.monotonic()
            self._busy[sandbox_id] -= 1
            if not self._busy[sandbox_id]:
                del self._busy[sandbox_id]

    @contextlib.asynccontextmanager
    async def _call(self, sandbox_id: str, poll: bool = False) -> AsyncIterator[aiohttp.ClientSession]:
        """A host call. A poll neither wakes a frozen sandbox (it raises Quiesced) nor counts as activity."""
        if sandbox_id in self._closed:
            raise Quiesced(f"sandbox {sandbox_id} is being checkpointed")
        if poll and self.asleep is not None and self.asleep(sandbox_id):
            raise Quiesced(f"sandbox {sandbox_id} is frozen while idle")
        assert self._http is not None, "AgentClient.start() was not called"
        with contextlib.nullcontext() if poll else self._activity(sandbox_id):
            self._calls[sandbox_id] += 1
            try:
                yield self._http
            finally:
                self._calls[sandbox_id] -= 1
                if not self._calls[sandbox_id]:
                    del self._calls[sandbox_id]
                    async with self._idle:
                        self._idle.notify_all()

    # -- host calls ----------------------------------------------------------------------------------------------
    async def wait_ready(self, sandbox_id: str, address: str, timeout: float) -> None:
        """Until the agent answers /health; RuntimeFailure after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            try:
                async with self._call(sandbox_id) as http, \
                        http.get(agent_url(address) + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status < 300:
                        return
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"agent of {sandbox_id} did not answer within {timeout:.0f}s")
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.1)

    async def healthy(self, sandbox_id: str, address: str, timeout: float | None = None) -> bool:
        """Whether the agent answers /health within `timeout` seconds (HEALTH_TIMEOUT) now (a pause's check)."""
        limit = aiohttp.ClientTimeout(total=timeout or HEALTH_TIMEOUT)
        try:
            async with self._call(sandbox_id) as http, \
                    http.get(agent_url(address) + "/health", timeout=limit) as r:
                return r.status < 300
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def init(self, sandbox_id: str, address: str, body: dict[str, Any], previous_token: str | None) -> None:
        headers = {"X-Access-Token": previous_token} if previous_token else {}
        async with self._call(sandbox_id) as http, \
                http.post(agent_url(address) + "/init", json=body, headers=headers) as r:
            if r.status >= 300:
                raise RuntimeFailure(f"agent of {sandbox_id} refused init: {r.status} {await r.text()}")

    async def metrics(self, sandbox_id: str, address: str, token: str) -> dict[str, Any] | None:
        """The agent's /metrics (disk figures), None if it answers something else."""
        async with self._call(sandbox_id, poll=True) as http, \
                http.get(agent_url(address) + "/metrics", headers={"X-Access-Token": token},
                         timeout=aiohttp.ClientTimeout(total=2)) as r:
            if r.status != 200:
                return None
            body = await r.json()
            return body if isinstance(body, dict) else None

    async def journal(self, sandbox_id: str, url: str, token: str, after: int, limit: int) -> tuple[int, Any]:
        """One page of the agent's journal: (status, body); the journal poller's transport."""
        async with self._call(sandbox_id, poll=True) as http, \
                http.get(url.rstrip("/") + "/journal", params={"after": str(after), "limit": str(limit)},
                         headers={"X-Access-Token": token}, timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return r.status, (await r.text())[:200]
            return r.status, await r.json(content_type=None)

    async def idle(self, sandbox_id: str, address: str, token: str) -> dict[str, Any]:
        """The agent's /keepstate/idle (agent/idle.py): {"idle", "why", "last"}; a poll."""
        async with self._call(sandbox_id, poll=True) as http, \
                http.get(agent_url(address) + "/keepstate/idle", headers={"X-Access-Token": token},
                         timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status != 200:
                raise RuntimeFailure(f"agent of {sandbox_id} answered /keepstate/idle with {r.status}")
            body = await r.json()
            if not isinstance(body, dict):
                raise RuntimeFailure(f"agent of {sandbox_id} answered /keepstate/idle with {body!r}")
            return body

    async def listening(self, sandbox_id: str, address: str, token: str) -> list[int] | None:
        """The agent's /keepstate/listening (agent/listening.py): the ports that listen on a reachable address; None
        from an agent that does not know the route (an image older than it)."""
        async with self._call(sandbox_id) as http, \
                http.get(agent_url(address) + "/keepstate/listening", headers={"X-Access-Token": token},
                         timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status == 404:
                return None
            if r.status != 200:
                raise RuntimeFailure(f"agent of {sandbox_id} answered /keepstate/listening with {r.status}")
            body = await r.json()
            ports = body.get("ports") if isinstance(body, dict) else None
            if not isinstance(ports, list) or not all(isinstance(p, int) for p in ports):
                raise RuntimeFailure(f"agent of {sandbox_id} answered /keepstate/listening with {body!r}")
            return ports

    async def export_files(self, sandbox_id: str, address: str, token: str, dest: Path) -> int:
        """The sandbox's files as changes against its template (agent/files_archive.py), into `dest`; their size.
        An incomplete stream (the agent failed midway) raises: nothing partial is ever kept."""
        size = 0
        async with self._call(sandbox_id) as http, \
                http.get(agent_url(address) + "/keepstate/files", headers={"X-Access-Token": token},
                         timeout=FILES_TIMEOUT) as r:
            if r.status != 200:
                raise RuntimeFailure(f"agent of {sandbox_id} refused to export its files: {r.status} "
                                     f"{(await r.text())[:300]}")
            with open(dest, "wb") as out:
                async for chunk in r.content.iter_chunked(1 << 20):
                    await asyncio.to_thread(out.write, chunk)
                    size += len(chunk)
        return size

    async def apply_files(self, sandbox_id: str, address: str, archive: Path, token: str | None = None) -> int:
        """Apply an export to a freshly booted sandbox (before its /init; `token`: a pooled one's); how many entries
        it held."""
        async def body() -> AsyncIterator[bytes]:
            with open(archive, "rb") as f:
                while chunk := await asyncio.to_thread(f.read, 1 << 20):
                    yield chunk

        async with self._call(sandbox_id) as http, \
                http.put(agent_url(address) + "/keepstate/files", data=body(), timeout=FILES_TIMEOUT,
                         headers={"X-Access-Token": token} if token else {}) as r:
            if r.status != 200:
                raise RuntimeFailure(f"agent of {sandbox_id} could not apply its files: {r.status} "
                                     f"{(await r.text())[:300]}")
            return int((await r.json()).get("entries", 0))

    async def run_command(self, sandbox_id: str, address: str, token: str, cmd: str, user: str, env: dict[str, str],
                          cwd: str | None, on_line: Callable[[str], None]) -> agent_exec.Result:
        """Run `cmd` with bash as `user` and wait for its end (a template build's step); each output line goes to
        `on_line`, from a thread."""
        async with self._call(sandbox_id):
            return await asyncio.to_thread(agent_exec.run, address, token, cmd, user, env, cwd, on_line)

    async def write_file(self, sandbox_id: str, address: str, token: str, path: str, source: Path) -> None:
        """Write `source` to `path` in the sandbox as root (`POST /files`, an octet-stream upload)."""
        async with self._call(sandbox_id) as http:
            with open(source, "rb") as f:
                async with http.post(agent_url(address) + "/files", params={"path": path, "username": "root"},
                                     data=f, headers={"X-Access-Token": token,
                                                      "Content-Type": "application/octet-stream"},
                                     timeout=aiohttp.ClientTimeout(total=600)) as r:
                    if r.status >= 300:
                        raise RuntimeFailure(f"writing {path} into sandbox {sandbox_id} failed: {r.status} "
                                             f"{(await r.text())[:300]}")

    # -- the router's requests -----------------------------------------------------------------------------------
    async def admit(self, sandbox_id: str, timeout: float = 120) -> None:
        """A proxied request waits while a snapshot or fork quiesces the sandbox (it runs on afterwards)."""
        event = self._closed.get(sandbox_id)
        if event is not None and sandbox_id in self._hold:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):  # not wait_for: 3.11's can lose a cancellation (gh-86296)
                    await event.wait()

    def proxy_pool(self, sandbox_id: str) -> SandboxConnections:
        """The sandbox's keep-alive pool of HTTP connections (a new one after the gate or a kill closed the last).
        While the gate is closed, a closed pool: no connection may be made into a sandbox being checkpointed (its
        connect raises UpstreamError, as when the gate closed the pool under it)."""
        if sandbox_id in self._closed:
            closed = SandboxConnections()
            closed.close()
            return closed
        pool = self._pools.get(sandbox_id)
        if pool is None or pool.closed:
            pool = self._pools[sandbox_id] = SandboxConnections()
        return pool

    def proxy_session(self, sandbox_id: str) -> aiohttp.ClientSession:
        """The aiohttp session the router's WebSockets into the sandbox use."""
        session = self._proxy.get(sandbox_id)
        if session is None or session.closed:
            session = self._proxy[sandbox_id] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5), auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            )
        return session

    @contextlib.contextmanager
    def proxying(self, sandbox_id: str, transport: asyncio.BaseTransport | None) -> Iterator[InFlight]:
        """Register a proxied request (before it connects: a frozen sandbox is thawed here)."""
        flight = InFlight(transport)
        with self._activity(sandbox_id):
            self._inflight.setdefault(sandbox_id, set()).add(flight)
            try:
                yield flight
            finally:
                self._inflight.get(sandbox_id, set()).discard(flight)

    def has_pool(self, sandbox_id: str) -> bool:
        session, pool = self._proxy.get(sandbox_id), self._pools.get(sandbox_id)
        return (session is not None and not session.closed) or (pool is not None and not pool.closed)

    async def close_pool(self, sandbox_id: str) -> None:
        """Close the router's keep-alive connections into the sandbox, unless a proxied request is in flight (the
        idle freezer, before a freeze: a connection closed while the sandbox is frozen leaves the host's FIN
        unanswered)."""
        if self._inflight.get(sandbox_id):
            return
        pool = self._pools.pop(sandbox_id, None)
        if pool is not None:
            pool.close()
        session = self._proxy.pop(sandbox_id, None)
        if session is not None:
            await session.close()

    def rejoin(self, sandbox_id: str, flight: InFlight) -> None:
        """A resumed stream is in flight again: the next gate cuts it too."""
        flight.cut = flight.resume = flight.held = False
        self._inflight.setdefault(sandbox_id, set()).add(flight)

    def _drop(self, sandbox_id: str, keep_resumable: bool = False) -> aiohttp.ClientSession | None:
        """Cut the sandbox's in-flight proxied requests and close its pool of connections (in use ones too); hand
        back its WebSocket session for closing.

        A request whose response has started loses its client connection (the SDK sees an interrupted stream); one
        whose response has not started only loses its upstream connection (closing the pool), and the router
        answers it with its JSON 502. With `keep_resumable` (a snapshot's gate: the sandbox runs on), a resumable
        stream loses its upstream connection only, and the router resumes it once the gate opens."""
        for flight in list(self._inflight.pop(sandbox_id, ())):
            flight.cut = True
            flight.held = keep_resumable
            flight.resume = keep_resumable and flight.resumable
            if flight.started and flight.transport is not None and not flight.resume:
                flight.transport.close()
        pool = self._pools.pop(sandbox_id, None)
        if pool is not None:
            pool.close()
        return self._proxy.pop(sandbox_id, None)

    def abort(self, sandbox_id: str) -> None:
        """The sandbox was killed, paused or timed out: cut every proxied request now."""
        session = self._drop(sandbox_id)
        if session is not None:
            asyncio.get_running_loop().create_task(session.close())

    def open_connections(self) -> Callable[[str], int]:
        """For tests: how many host calls are in flight into a sandbox."""
        return lambda sid: self._calls[sid]
