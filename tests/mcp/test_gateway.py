"""The MCP gateway (keepstate.agent.mcp_gateway; docs/design/mcp-gateway.md) as a program on this host: started as
E2B's SDK starts it (`mcp-gateway --config JSON` with GATEWAY_ACCESS_TOKEN, exit 0 once it answers), with two stdio
servers of keepstate.testing.mcp_servers as `github/<owner>/<repo>` servers whose clones are already there, and the
official `mcp` client at its Streamable-HTTP endpoint."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.sdk.sdkharness import REPO, free_port


@dataclass
class Gateway:
    dir: Path
    port: int
    token: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def run(self, config: object, timeout: float = 30, token: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": str(REPO), "MCP_GATEWAY_SERVERS_DIR": str(self.dir / "servers"),
               "GATEWAY_ACCESS_TOKEN": token or self.token}
        return subprocess.run(
            [sys.executable, "-m", "keepstate.agent.mcp_gateway", "--config", json.dumps(config), "--host",
             "127.0.0.1", "--port", str(self.port), "--token-file", str(self.dir / "etc" / ".token"),
             "--log-file", str(self.dir / "gateway.log"), "--pid-file", str(self.dir / "gateway.pid"),
             "--ready-timeout", str(timeout)],
            env=env, capture_output=True, text=True, timeout=timeout + 30)

    def stop(self) -> None:
        pid_file = self.dir / "gateway.pid"
        if pid_file.exists():
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    for repo in ("alpha", "beta"):
        (tmp_path / "servers" / "github" / "ks" / repo).mkdir(parents=True)  # "cloned" already: no network
    gw = Gateway(tmp_path, free_port(), str(uuid.uuid4()))
    yield gw
    gw.stop()


def _server(name: str, tools: str = "echo,add,count,exit_now") -> dict[str, object]:
    return {"runCmd": f"{sys.executable} -m keepstate.testing.mcp_servers {name} {tools}",
            "envs": {"PYTHONPATH": str(REPO)}}


def _http(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(url, headers=headers or {}, method="GET")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


async def _session(gw: Gateway, calls: list[tuple[str, dict[str, object]]]) -> tuple[list[str], list[object]]:
    """The tools listed and each call's result, through the official client with the token."""
    import httpx2
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {gw.token}"}, timeout=30) as http, \
            streamable_http_client(gw.url, http_client=http) as (read, write), ClientSession(read, write) as s:
        await s.initialize()
        names = [t.name for t in (await s.list_tools()).tools]
        results = []
        for name, args in calls:
            r = await s.call_tool(name, args)
            results.append(r.structured_content if r.structured_content is not None else
                           [c.text for c in r.content if c.type == "text"])
        return names, results


def test_servers_merged_behind_one_endpoint_that_needs_the_token(gateway: Gateway) -> None:
    done = gateway.run({"github/ks/alpha": _server("alpha"), "github/ks/beta": _server("beta", "echo")})
    assert done.returncode == 0, done.stderr
    token_file = gateway.dir / "etc" / ".token"
    assert token_file.read_text() == gateway.token and stat.S_IMODE(token_file.stat().st_mode) == 0o600
    names, results = asyncio.run(_session(gateway, [
        ("github_ks_alpha__echo", {"text": "hi"}), ("github_ks_beta__echo", {"text": "hi"}),
        ("add", {"a": 2, "b": 3})]))
    # `echo` is on both: prefixed by its server; the others are alpha's alone and keep their names.
    assert sorted(names) == ["add", "count", "exit_now", "github_ks_alpha__echo", "github_ks_beta__echo"]
    assert results[0] in (["alpha: hi"], {"result": "alpha: hi"})
    assert results[1] in (["beta: hi"], {"result": "beta: hi"})
    assert results[2] in (["5"], {"result": 5})
    assert _http(f"http://127.0.0.1:{gateway.port}/health")[0] == 200  # no token needed
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": gateway.token}):
        status, body = _http(gateway.url, headers)
        assert status == 401 and body["error"] == "unauthorized", (headers, body)


def test_a_server_that_exits_is_started_again_on_its_next_call(gateway: Gateway) -> None:
    assert gateway.run({"github/ks/alpha": _server("alpha")}).returncode == 0

    async def scenario() -> list[object]:
        import httpx2
        from mcp.client.session import ClientSession
        from mcp.client.streamable_http import streamable_http_client

        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {gateway.token}"}, timeout=30) as http, \
                streamable_http_client(gateway.url, http_client=http) as (read, write), \
                ClientSession(read, write) as s:
            await s.initialize()
            counts = [(await s.call_tool("count", {})).structured_content for _ in range(2)]
            with pytest.raises(Exception):  # noqa: B017,PT011 - the server died mid-call: an MCP error, any kind
                await s.call_tool("exit_now", {})
            counts.append((await s.call_tool("count", {})).structured_content)
            return counts

    assert asyncio.run(scenario()) == [{"result": 1}, {"result": 2}, {"result": 1}]  # a new process counts anew


@pytest.mark.parametrize(("config", "words"), [
    ({"nope": {}}, "unknown MCP server 'nope'"),
    ({"github/ks/alpha": {}}, "runCmd"),
    ({"github/justone": {"runCmd": "x"}}, "github/<owner>/<repo>"),
    ({"time": []}, "must be an object"),
    ({"filesystem": {"paths": []}}, "paths"),
    ([], "JSON object"),
])
def test_a_config_it_cannot_run_is_refused_before_anything_starts(gateway: Gateway, config: object,
                                                                  words: str) -> None:
    done = gateway.run(config)
    assert done.returncode == 2 and words in done.stderr, done.stderr
    assert not (gateway.dir / "gateway.pid").exists()


def test_a_server_that_does_not_start_fails_the_launch_with_its_reason(gateway: Gateway) -> None:
    done = gateway.run({"github/ks/alpha": {"runCmd": "echo 'no such server here' >&2; exit 7"}}, timeout=20)
    assert done.returncode == 1 and "failed to start" in done.stderr and "alpha" in done.stderr, done.stderr
    assert not _answers(gateway.port)  # no daemon left behind


def _answers(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_pull_names_what_is_not_installed() -> None:
    def pull(*names: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "keepstate.agent.mcp_gateway", "pull", *names],
                              env={**os.environ, "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, timeout=60)

    absent = pull("time", "memory")
    assert absent.returncode == 1 and "time, memory" in absent.stderr
    unknown = pull("time", "nope")
    assert unknown.returncode == 2 and "nope" in unknown.stderr
