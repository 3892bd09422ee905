"""MCP through the stock SDK (docs/design/mcp-gateway.md): `Sandbox.create(mcp=...)` picks the `mcp-gateway`
template and starts the gateway in it; the official `mcp` client lists and calls the servers' tools at the sandbox's
MCP endpoint with `get_mcp_token()`, and is refused without it; the servers and their state survive a pause."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import uuid
from typing import Any

import pytest
from e2b import Sandbox, SandboxQuery
from e2b.exceptions import SandboxException

from sdkharness import DOMAIN, Server, fake_internet

pytestmark = [
    pytest.mark.skipif(not hasattr(Sandbox, "get_mcp_url"), reason="this SDK release has no MCP option"),
    pytest.mark.skipif(importlib.util.find_spec("mcp") is None,
                       reason="the official `mcp` client is not installed in this venv"),
]


def _endpoint(sbx: Sandbox, server: Server) -> tuple[str, dict[str, str]]:
    """Where the client talks: `get_mcp_url()` when the SDK knows only the domain (names resolved, TLS); else the
    router's plain listener, the port named by E2B's routing headers."""
    auth = {"Authorization": f"Bearer {sbx.get_mcp_token()}"}
    if DOMAIN:
        return sbx.get_mcp_url(), auth
    return f"{server.url}/mcp", {**auth, "E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "50005"}


def _use(url: str, headers: dict[str, str], calls: list[tuple[str, dict[str, Any]]],
         check: bool = True) -> tuple[list[str], list[str]]:
    async def run() -> tuple[list[str], list[str]]:
        import httpx2
        from mcp.client.session import ClientSession
        from mcp.client.streamable_http import streamable_http_client

        async with httpx2.AsyncClient(headers=headers, timeout=60) as http, \
                streamable_http_client(url, http_client=http) as (read, write), ClientSession(read, write) as s:
            await s.initialize()
            names = [t.name for t in (await s.list_tools()).tools]
            texts = []
            for name, args in calls:
                result = await s.call_tool(name, args)
                assert not (check and result.is_error), result
                texts.append("".join(c.text for c in result.content if c.type == "text"))
            return names, texts

    return asyncio.run(run())


def _status(url: str, headers: dict[str, str]) -> int:
    import httpx2

    return httpx2.post(url, headers={**headers, "Content-Type": "application/json",
                                     "Accept": "application/json, text/event-stream"},
                       content=json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping"}), timeout=30).status_code


def test_catalog_servers_behind_the_gateway_survive_a_pause(server: Server) -> None:
    sbx = Sandbox.create(mcp={"time": {}, "memory": {}, "filesystem": {"paths": ["/home/user"]}}, timeout=300)
    try:
        sbx.files.write("/home/user/note.txt", "hello from the sandbox")
        url, headers = _endpoint(sbx, server)
        entity = {"entities": [{"name": "ks", "entityType": "project", "observations": ["durable"]}]}
        names, texts = _use(url, headers, [
            ("get_current_time", {"timezone": "UTC"}),
            ("read_text_file", {"path": "/home/user/note.txt"}),
            ("create_entities", entity),
        ])
        assert {"get_current_time", "read_text_file", "create_entities", "read_graph"} <= set(names)
        assert json.loads(texts[0])["timezone"] == "UTC"
        assert texts[1] == "hello from the sandbox"
        no_token = {k: v for k, v in headers.items() if k != "Authorization"}
        assert _status(url, no_token) == 401
        assert _status(url, {**no_token, "Authorization": "Bearer wrong"}) == 401

        sbx.pause()
        again = Sandbox.connect(sbx.sandbox_id)
        again._mcp_token = None  # as a client that has only the sandbox's ID: the token comes from its file
        assert again.get_mcp_token() == headers["Authorization"].removeprefix("Bearer ")
        _, (graph,) = _use(*_endpoint(again, server), [("read_graph", {})])
        assert "durable" in graph  # the memory server's state came through the pause
    finally:
        sbx.kill()


def test_a_server_the_gateway_cannot_run_fails_the_create(server: Server) -> None:
    tag = str(uuid.uuid4())
    with pytest.raises(SandboxException, match="unknown MCP server 'nope'"):
        Sandbox.create(mcp={"nope": {}}, metadata={"test": tag}, timeout=120)
    left = Sandbox.list(query=SandboxQuery(metadata={"test": tag})).next_items()  # the SDK killed what it made
    assert left == []


@pytest.mark.skipif(fake_internet() is None, reason="needs the run's fake internet (scripts/test.sh starts one)")
def test_the_fetch_server_reaches_a_site_through_the_sandbox_egress(server: Server) -> None:
    """The fake internet's sites are on documentation addresses, which the fetch server refuses by default as it
    does private ones; `allowPrivateIps` (a KeepState setting) lets it fetch them."""
    refusing = Sandbox.create(mcp={"fetch": {}}, timeout=300)
    fetching = Sandbox.create(mcp={"fetch": {"allowPrivateIps": True}}, timeout=300)
    try:
        _, (refused,) = _use(*_endpoint(refusing, server), [("fetch", {"url": "http://plain.test/", "raw": True})],
                             check=False)
        assert "Refused to fetch" in refused, refused
        names, (page,) = _use(*_endpoint(fetching, server), [("fetch", {"url": "http://plain.test/", "raw": True})])
        assert "fetch" in names
        assert "site plain.test" in page, page
    finally:
        refusing.kill()
        fetching.kill()


def test_add_mcp_server_in_a_template_build_checks_the_servers(e2b_env: None) -> None:
    """`Template().from_template("mcp-gateway").add_mcp_server(...)` runs `mcp-gateway pull` as root at build: the
    catalog's preinstalled servers pass, and a server this gateway cannot run fails the build, naming it."""
    from e2b import Template
    from e2b.exceptions import BuildException

    name = f"ks-test-mcp-{uuid.uuid4().hex[:8]}"
    Template.build(Template().from_template("mcp-gateway").add_mcp_server(["time", "fetch"]), name,
                   cpu_count=1, memory_mb=1024)
    sbx = Sandbox.create(name, mcp={"time": {}}, timeout=300)
    try:
        assert sbx.get_mcp_token()
        assert sbx.commands.run("command -v mcp-server-time").exit_code == 0
    finally:
        sbx.kill()
    with pytest.raises(BuildException, match="exa"):
        Template.build(Template().from_template("mcp-gateway").add_mcp_server("exa"), name + "-bad",
                       cpu_count=1, memory_mb=1024)
