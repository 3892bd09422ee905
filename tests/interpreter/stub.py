"""A minimal E2B control plane + data-plane router that runs one bridge process per sandbox.

Stands in for the KeepState server until sandboxes exist: `POST /v2/sandboxes` starts
`python -m keepstate.agent.interpreter` from the kernel venv on a free port; data-plane requests
are routed by `E2b-Sandbox-Id`/`E2b-Sandbox-Port` (49999 → that bridge, 49983 → a tiny envd with
/health and /envs), as protocol notes §1.6 describe. Runs its own event loop in a thread so both the
sync and the async SDK can use it.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

REPO = Path(__file__).resolve().parents[2]
STARTUP = REPO / "keepstate" / "agent" / "interpreter" / "startup" / "00_e2b.py"
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


@dataclass
class StubSandbox:
    id: str
    token: str
    envs: dict[str, str]
    home: Path
    process: asyncio.subprocess.Process | None = None
    port: int = 0
    log: Path | None = None
    streams: set[web.StreamResponse] = field(default_factory=set)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"code": status, "message": message}, status=status)


class Stub:
    def __init__(self, venv: Path, workdir: Path, default_languages: str = "python,javascript") -> None:
        self.venv = venv
        self.workdir = workdir
        self.default_languages = default_languages
        self.sandboxes: dict[str, StubSandbox] = {}
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._client: aiohttp.ClientSession | None = None

    # -- thread plumbing -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._call(self._start())

    def stop(self) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def _call(self, coro: Any, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def kill(self, sandbox_id: str) -> None:
        self._call(self._kill(sandbox_id))

    def home(self, sandbox_id: str) -> str:
        return str(self.sandboxes[sandbox_id].home)

    # -- server ----------------------------------------------------------------------------------

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def _stop(self) -> None:
        for sid in list(self.sandboxes):
            await self._kill(sid)
        if self._client is not None:
            await self._client.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        port = request.headers.get("E2b-Sandbox-Port")
        if port is not None:
            sbx = self.sandboxes.get(request.headers.get("E2b-Sandbox-Id", ""))
            if sbx is None:
                return web.json_response({"sandboxId": request.headers.get("E2b-Sandbox-Id"),
                                          "message": "The sandbox was not found", "code": 502}, status=502)
            if port == "49983":
                return await self._envd(request, sbx)
            if port == "49999":
                return await self._proxy(request, sbx)
            return _error(502, f"port {port} is not open")
        m = re.fullmatch(r"/envd/([a-z0-9]+)/envs", request.path)
        if m:  # the bridge asking its sandbox's envd (no routing headers from inside a sandbox)
            sbx = self.sandboxes.get(m.group(1))
            if sbx is None:
                return _error(502, "sandbox not found")
            if request.headers.get("X-Access-Token") != sbx.token:
                return _error(401, "unauthorized access, please provide a valid access token")
            return web.json_response(sbx.envs)
        if request.method == "POST" and request.path == "/v2/sandboxes":
            return await self._create(request)
        m = re.fullmatch(r"/sandboxes/([a-z0-9]+)", request.path)
        if m and request.method == "DELETE":
            if m.group(1) not in self.sandboxes:
                return _error(404, f"sandbox {m.group(1)!r} not found")
            await self._kill(m.group(1))
            return web.Response(status=204)
        return _error(404, f"stub: no route for {request.method} {request.path}")

    async def _envd(self, request: web.Request, sbx: StubSandbox) -> web.StreamResponse:
        if request.path == "/health":
            return web.Response(status=204)
        if request.path == "/envs":
            if request.headers.get("X-Access-Token") != sbx.token:
                return _error(401, "unauthorized access, please provide a valid access token")
            return web.json_response(sbx.envs)
        return _error(404, "stub envd: not implemented")

    async def _create(self, request: web.Request) -> web.Response:
        body = await request.json()
        sid = secrets.token_hex(10)
        home = self.workdir / sid
        home.mkdir(parents=True)
        sbx = StubSandbox(id=sid, token=secrets.token_hex(16), envs=dict(body.get("envVars") or {}), home=home)
        await self._launch(sbx)
        self.sandboxes[sid] = sbx
        return web.json_response({
            "templateID": body.get("templateID", "code-interpreter-v1"), "sandboxID": sid,
            "clientID": "6532622b", "envdVersion": "0.6.13", "envdAccessToken": sbx.token,
            "trafficAccessToken": None, "domain": None, "alias": "code-interpreter-v1",
        }, status=201)

    async def _launch(self, sbx: StubSandbox) -> None:
        ipython = sbx.home / ".ipython" / "profile_default" / "startup"
        ipython.mkdir(parents=True)
        shutil.copy(STARTUP, ipython / STARTUP.name)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "PYTEST", "JUPYTER"))}
        env.update(PYTHONPATH=str(REPO), HOME=str(sbx.home), IPYTHONDIR=str(sbx.home / ".ipython"),
                   MPLCONFIGDIR=str(sbx.home / ".mpl"), PATH=f"{self.venv / 'bin'}:{env.get('PATH', '')}",
                   PYTHONUNBUFFERED="1")
        env.update(sbx.envs)  # the agent starts services with the sandbox's env vars
        sbx.log = sbx.home.parent / f"{sbx.id}.bridge.log"
        with open(sbx.log, "wb") as log:
            sbx.process = await asyncio.create_subprocess_exec(
                str(self.venv / "bin" / "python"), "-m", "keepstate.agent.interpreter",
                "--host", "127.0.0.1", "--port", "0", "--workdir", str(sbx.home), "--kernel-user", "",
                "--envd-url", f"{self.url}/envd/{sbx.id}", "--default-languages", self.default_languages,
                "--runtime-dir", f"/tmp/ksi-{sbx.id}",
                stdout=log, stderr=log, env=env, cwd=str(sbx.home))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", sbx.log.read_text())
            if m:
                sbx.port = int(m.group(1))
                return
            if sbx.process.returncode is not None:
                break
            await asyncio.sleep(0.05)
        raise RuntimeError(f"bridge did not start:\n{sbx.log.read_text()}")

    async def _kill(self, sid: str) -> None:
        sbx = self.sandboxes.pop(sid, None)
        if sbx is None:
            return
        for resp in list(sbx.streams):  # a killed sandbox drops its connections
            if resp.task is not None:
                resp.task.cancel()
        if sbx.process is not None and sbx.process.returncode is None:
            sbx.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(sbx.process.wait(), 20)
            except TimeoutError:
                sbx.process.kill()
                await sbx.process.wait()
        shutil.rmtree(f"/tmp/ksi-{sid}", ignore_errors=True)

    async def _proxy(self, request: web.Request, sbx: StubSandbox) -> web.StreamResponse:
        assert self._client is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        body = await request.read()
        url = f"http://127.0.0.1:{sbx.port}{request.path_qs}"
        try:
            async with self._client.request(request.method, url, headers=headers, data=body) as upstream:
                resp = web.StreamResponse(status=upstream.status, headers={
                    k: v for k, v in upstream.headers.items() if k.lower() not in _HOP})
                await resp.prepare(request)
                sbx.streams.add(resp)
                try:
                    async for chunk in upstream.content.iter_any():
                        await resp.write(chunk)
                finally:
                    sbx.streams.discard(resp)
                await resp.write_eof()
                return resp
        except aiohttp.ClientError:
            if request.transport is not None:
                request.transport.close()  # mid-stream failure: drop the client's connection too
            raise
