"""A server is a node of its database: it joins at start (`GET /nodes`, `keepstate nodes ls`), leaves at stop, and
while fenced answers 503 to everything but its health and the node list. Two nodes on one PostgreSQL database keep
to their own sandboxes (each adopts only its own rows; the other's it relays)."""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
from pathlib import Path

from keepstate.api.nodes import MEMBERSHIP
from keepstate.db.engine import Database
from keepstate.db.repos import Nodes
from keepstate.db.url import default_url
from keepstate.testing.databases import postgres  # noqa: F401
from keepstate.testing.postgres import PostgresServer

from ..sandbox.conftest import Served, serving


async def nodes_of(s: Served) -> list[dict[str, object]]:
    status, body = await s.call("GET", "/nodes")
    assert status == 200, body
    return list(body)


async def test_a_server_is_a_node_of_its_database_and_leaves_when_it_stops(tmp_path: Path) -> None:
    home = tmp_path / "home"
    async with serving(home=home) as s:
        [me] = await nodes_of(s)
        assert (me["nodeID"], me["state"], me["incarnation"], me["self"]) == ("local", "alive", 1, True)
        assert 0 < float(me["leaseRemainingSeconds"]) <= 10  # type: ignore[arg-type]
        assert me["runscRelease"] == "fake-1" and me["maxSandboxes"] > 0  # type: ignore[operator]
        argv = [sys.executable, "-m", "keepstate.cli.main", "nodes", "ls", "--json", "--home", str(home)]
        shown = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True)
        assert shown.returncode == 0, shown.stderr
        assert [(n["nodeID"], n["self"]) for n in json.loads(shown.stdout)] == [("local", False)]
    db = await Database.open(default_url(home))
    try:
        [left] = await Nodes(db).list()
        assert left.state == "left"  # a clean stop ends its lease at once
    finally:
        await db.close()


async def test_a_fenced_node_answers_503_but_its_health_and_the_node_list() -> None:
    async with serving(node="a") as s:
        assert s.app is not None
        membership = s.app[MEMBERSHIP]
        status, made = await s.call("POST", "/sandboxes", {"templateID": "base", "timeout": 60})
        assert status == 201, made
        membership.fenced = "its lease could not be renewed (test)"
        async with s.http.post(s.url + "/sandboxes", json={"templateID": "base"}, headers=s.headers) as r:
            body = await r.json()
            assert r.status == 503 and r.headers["Retry-After"] == "2" and r.headers["Should-Retry"] == "true"
            assert body["code"] == 503 and "fenced" in body["message"]
        async with s.http.get(s.url + "/health", headers={"E2b-Sandbox-Id": made["sandboxID"]}) as r:
            assert r.status == 503  # the data plane too: a request for its sandbox
        async with s.http.get(s.url + "/health") as r:
            assert r.status == 200
        assert [n["nodeID"] for n in await nodes_of(s)] == ["a"]
        membership.fenced = None
        status, listed = await s.call("GET", "/v2/sandboxes")
        assert status == 200 and [x["sandboxID"] for x in listed] == [made["sandboxID"]]


async def test_two_nodes_on_one_database_each_keep_to_their_own_sandboxes(postgres: PostgresServer) -> None:  # noqa: F811
    url = postgres.createdb(f"nodes_{secrets.token_hex(6)}")
    async with serving(node="a", db_url=url) as a:
        status, made = await a.call("POST", "/sandboxes", {"templateID": "base", "timeout": 60})
        assert status == 201, made
        sid = made["sandboxID"]
        before = await a.row(sid)
        async with serving(node="b", db_url=url, key=a.key) as b:  # starts (and adopts) after a's create
            assert [(n["nodeID"], n["self"]) for n in await nodes_of(b)] == [("a", False), ("b", True)]
            assert sid not in b.manager.records  # not adopted: b answers for it by relaying to a
            assert (await b.call("GET", f"/sandboxes/{sid}"))[0] == 200
            after = await a.row(sid)
            assert after is not None and before is not None and after.state == before.state
            assert (await a.call("GET", f"/sandboxes/{sid}"))[0] == 200
        assert {n["nodeID"]: n["state"] for n in await nodes_of(a)} == {"a": "alive", "b": "left"}


async def test_a_drained_node_takes_no_creates_and_serves_what_it_has() -> None:
    async with serving(node="a", lease=(1.0, 0.1, 0.4)) as s:
        assert s.app is not None
        status, made = await s.call("POST", "/sandboxes", {"templateID": "base", "timeout": 60})
        assert status == 201, made
        assert await Nodes(s.manager.db).drain("a")  # what `keepstate nodes drain a` does
        while s.app[MEMBERSHIP].state != "draining":  # heard at its next renewal
            await asyncio.sleep(0.05)
        async with s.http.post(s.url + "/sandboxes", json={"templateID": "base"}, headers=s.headers) as r:
            body = await r.json()
            assert r.status == 503 and r.headers["Should-Retry"] == "false" and "draining" in body["message"]
        assert (await s.call("GET", f"/sandboxes/{made['sandboxID']}"))[0] == 200
        assert [(n["nodeID"], n["state"]) for n in await nodes_of(s)] == [("a", "draining")]
