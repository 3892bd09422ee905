"""Any node answers, the rest (docs/design/cluster.md, "Any node answers"): a WebSocket to a port URL of a sandbox
on node A, opened through node B, goes over the hop (text, a 1 MiB binary message, the subprotocol chosen end to
end, a close's code and reason from either end to the other, nothing left running after); the hop carries the
epoch of the sandbox's row, and an owner that does not hold the sandbox, or holds it at another epoch, answers 421,
after which the relaying node looks again and retries once.

The sandbox's port is served by an aiohttp server on the fake instance's address (as in
tests/sandbox/test_upstream.py). What an owner is asked about a hop is recorded by wrapping `Relay.refusal`, which
every node calls for every request relayed to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from keepstate.api import relay as relay_module
from keepstate.api.relay import EPOCH, RELAY, RELAYED, Owner, Relay
from keepstate.db.repos import Sandboxes
from keepstate.db.schema import sandboxes
from keepstate.testing.databases import postgres  # noqa: F401
from keepstate.testing.postgres import PostgresServer

from ..sandbox.conftest import Served, serving

LEASE = (1.0, 0.1, 0.4)
PORT = 8000
PROTOCOL = "binary"  # noVNC's


@dataclass
class Echo:
    """The sandbox's WebSocket server: echoes each message, closes with a code and reason when told
    ("close <code> <reason>"), and records the close it was sent."""

    handshakes: list[dict[str, str]] = field(default_factory=list)
    closes: asyncio.Queue[tuple[int, str]] = field(default_factory=asyncio.Queue)

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        self.handshakes.append(dict(request.headers))
        ws = web.WebSocketResponse(protocols=(PROTOCOL,))
        await ws.prepare(request)
        while True:
            msg = await ws.receive()
            if msg.type is aiohttp.WSMsgType.TEXT and msg.data.startswith("close "):
                _, code, reason = msg.data.split(" ", 2)
                await ws.close(code=int(code), message=reason.encode())
            elif msg.type is aiohttp.WSMsgType.TEXT:
                await ws.send_str(msg.data)
            elif msg.type is aiohttp.WSMsgType.BINARY:
                await ws.send_bytes(msg.data)
            else:
                if msg.type is aiohttp.WSMsgType.CLOSE:
                    self.closes.put_nowait((msg.data, msg.extra or ""))
                break
        return ws


@dataclass
class Cluster:
    owner: Served  # node A: the one that holds the sandbox
    via: Served  # node B: the other one
    sid: str
    echo: Echo
    relay: Relay  # node B's
    hops: list[tuple[str, str | None, int | None]]  # (the node asked, the epoch the hop carried, the node's epoch)

    @property
    def names(self) -> tuple[str, str]:
        """The node names of A and B."""
        return self.owner.manager.rows.node_id, self.via.manager.rows.node_id

    def port_url(self, node: Served) -> tuple[str, dict[str, str]]:
        return node.url + "/ws?x=1", {"Host": f"{PORT}-{self.sid}.localhost"}

    async def epoch(self) -> int:
        found = await Sandboxes(self.owner.manager.db).get(self.sid)
        assert found is not None
        return found.epoch

    def remember(self, owner: Owner) -> None:
        """Make node B believe the sandbox is `owner`'s (as it would after a move it has not looked up yet)."""
        self.relay._owners[self.sid] = (time.monotonic() + 3600, owner)  # noqa: SLF001


@contextlib.asynccontextmanager
async def cluster(pg: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    hops: list[tuple[str, str | None, int | None]] = []
    refusal = Relay.refusal

    def recorded(self: Relay, request: web.Request, sandbox_id: str, held: bool,
                 epoch: int | None) -> web.Response | None:
        hops.append((self.node_id, request.headers.get(EPOCH), epoch))
        return refusal(self, request, sandbox_id, held, epoch)

    monkeypatch.setattr(Relay, "refusal", recorded)
    url = pg.createdb(f"relay_ws_{secrets.token_hex(6)}")
    store = f"file://{tmp_path / 'store'}"
    async with serving(node="a", db_url=url, store_url=store, lease=LEASE) as a, \
            serving(node="b", db_url=url, store_url=store, key=a.key, lease=LEASE) as b:
        status, made = await a.call("POST", "/sandboxes", {"templateID": "base", "timeout": 300})
        assert status == 201, made
        sid = made["sandboxID"]
        if sid not in a.manager.records:  # placed on b: b is "A" then
            a, b = b, a
        assert sid in a.manager.records and sid not in b.manager.records
        echo = Echo()
        app = web.Application()
        app.router.add_get("/ws", echo.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, a.manager.records[sid].address, PORT).start()
        assert b.app is not None
        try:
            yield Cluster(a, b, sid, echo, b.app[RELAY], hops)
        finally:
            await runner.cleanup()


async def pumps_done() -> None:
    """Until no WebSocket pump of this process runs (a leak would hang here, and the test time out)."""
    async with asyncio.timeout(30):
        while any(getattr(t.get_coro(), "__qualname__", "") == relay_module._pump.__qualname__  # noqa: SLF001
                  for t in asyncio.all_tasks()):
            await asyncio.sleep(0.01)


async def test_a_websocket_goes_over_the_hop(postgres: PostgresServer, tmp_path: Path,  # noqa: F811
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    async with cluster(postgres, tmp_path, monkeypatch) as c:
        url, host = c.port_url(c.via)
        epoch = await c.epoch()
        a, b = c.names
        async with c.via.http.ws_connect(url, headers=host, protocols=(PROTOCOL,)) as ws:
            assert ws.protocol == PROTOCOL  # chosen by the sandbox's server, through A's router and B
            await ws.send_str("hello ü")
            assert (await ws.receive()).data == "hello ü"
            big = secrets.token_bytes(1 << 20)
            await ws.send_bytes(big)
            back = await ws.receive()
            assert back.type is aiohttp.WSMsgType.BINARY and back.data == big
            await ws.send_bytes(b"")
            assert (await ws.receive()).data == b""
            await ws.close(code=4001, message=b"client bye")  # the client closes: so does the sandbox's end
        assert await c.echo.closes.get() == (4001, "client bye")
        assert c.hops == [(a, str(epoch), epoch)]  # one hop, to A, carrying the row's epoch, which A holds
        # The cluster's hop headers are the nodes': the sandbox's own server never sees them.
        assert RELAYED not in c.echo.handshakes[0] and EPOCH not in c.echo.handshakes[0]
        await pumps_done()

        async with c.via.http.ws_connect(url, headers=host, protocols=(PROTOCOL,)) as ws:
            await ws.send_str("close 4002 server bye")  # the sandbox's server closes: so does the client's end
            msg = await ws.receive()
            assert (msg.type, msg.data, msg.extra) == (aiohttp.WSMsgType.CLOSE, 4002, "server bye")
        assert ws.close_code == 4002
        await pumps_done()

        # Through the E2B headers as well as the Host, and without a subprotocol: none is chosen
        async with c.via.http.ws_connect(c.via.url + "/ws", headers={"E2b-Sandbox-Id": c.sid,
                                                                 "E2b-Sandbox-Port": str(PORT)}) as ws:
            assert ws.protocol is None
            await ws.send_str("again")
            assert (await ws.receive()).data == "again"
        assert await c.echo.closes.get() == (1000, "")
        await pumps_done()

        # A refused upgrade gives the client the owner's status: no server on that port of the sandbox
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            async with c.via.http.ws_connect(c.via.url + "/ws", headers={"Host": f"{PORT + 1}-{c.sid}.localhost"}):
                pass
        assert refused.value.status == 502


async def test_a_hop_to_an_owner_that_does_not_hold_the_sandbox_looks_again(
        postgres: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    async with cluster(postgres, tmp_path, monkeypatch) as c:
        url, host = c.port_url(c.via)
        epoch = await c.epoch()
        a, b = c.names
        a_address = c.owner.url
        relay = c.relay

        # B believes a node that does not hold the sandbox has it (here B itself, as node "c"): that node answers
        # the upgrade 421, B looks again and goes to A
        c.remember(Owner("c", c.via.url, epoch))
        async with c.via.http.ws_connect(url, headers=host, protocols=(PROTOCOL,)) as ws:
            await ws.send_str("moved")
            assert (await ws.receive()).data == "moved"
        assert c.hops == [(b, str(epoch), None), (a, str(epoch), epoch)]
        assert await relay.owner(c.sid) == Owner(a, a_address, epoch)  # what B knows now

        # B's look at the row is stale (another epoch than A holds): A answers 421, B looks again
        c.hops.clear()
        c.remember(Owner(a, a_address, epoch + 7))
        async with c.via.http.ws_connect(url, headers=host, protocols=(PROTOCOL,)) as ws:
            await ws.send_str("fenced")
            assert (await ws.receive()).data == "fenced"
        assert c.hops == [(a, str(epoch + 7), epoch), (a, str(epoch), epoch)]
        c.remember(Owner(a, a_address, epoch + 7))  # the same for a call of the control plane
        status, info = await c.via.call("GET", f"/sandboxes/{c.sid}")
        assert status == 200 and info["sandboxID"] == c.sid
        assert await relay.owner(c.sid) == Owner(a, a_address, epoch)
        await pumps_done()

        # Asked directly: A refuses a hop at another epoch, or for a sandbox it does not hold; it serves one at its
        # epoch, and one that names none
        relayed = {**c.owner.headers, RELAYED: "z"}
        for headers, status in (({EPOCH: str(epoch + 1)}, 421), ({EPOCH: str(epoch)}, 200), ({}, 200)):
            async with c.owner.http.get(f"{c.owner.url}/sandboxes/{c.sid}", headers={**relayed, **headers}) as r:
                assert r.status == status, await r.text()
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            async with c.owner.http.ws_connect(c.port_url(c.owner)[0], headers={**host, RELAYED: "z", EPOCH: "99"}):
                pass
        assert refused.value.status == 421
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            async with c.owner.http.ws_connect(c.owner.url + "/ws", headers={"Host": f"{PORT}-nosuchsandbox.localhost",
                                                                     RELAYED: "z"}):
                pass
        assert refused.value.status == 421

        # A no longer holds the row's epoch (it moved on in the database: A is fenced from it): every hop is
        # refused, the retry too, and the client gets the 421
        await set_epoch(c, epoch + 1)
        try:
            relay.forget(c.sid)
            c.hops.clear()
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                async with c.via.http.ws_connect(url, headers=host, protocols=(PROTOCOL,)):
                    pass
            assert refused.value.status == 421
            assert c.hops == [(a, str(epoch + 1), epoch)] * 2
        finally:
            await set_epoch(c, epoch)
        assert len(c.echo.handshakes) == 2  # the refused upgrades never reached the sandbox


async def set_epoch(c: Cluster, epoch: int) -> None:
    async with c.owner.manager.db.transaction() as conn:
        await conn.execute(sandboxes.update().where(sandboxes.c.sandbox_id == c.sid).values(epoch=epoch))
