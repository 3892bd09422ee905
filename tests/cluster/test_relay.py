"""Any node answers: through node B, the control plane and the data plane reach a sandbox that node A owns, in one
hop, byte for byte (a file written through B is read through A and back); a relayed request is never relayed again;
a sandbox of a gone node is not relayed (B answers for it itself)."""

from __future__ import annotations

import secrets
from pathlib import Path

from keepstate.testing.databases import postgres  # noqa: F401
from keepstate.testing.postgres import PostgresServer

from ..sandbox.conftest import serving
from ..sandbox.test_races import read_file, write_file

LEASE = (1.0, 0.1, 0.4)


async def test_another_node_answers_for_a_sandbox_in_one_hop(postgres: PostgresServer,  # noqa: F811
                                                             tmp_path: Path) -> None:
    url = postgres.createdb(f"relay_{secrets.token_hex(6)}")
    store = f"file://{tmp_path / 'store'}"
    async with serving(node="a", db_url=url, store_url=store, lease=LEASE) as a, \
            serving(node="b", db_url=url, store_url=store, key=a.key, lease=LEASE) as b:
        status, on_b = await b.call("POST", "/sandboxes", {"templateID": "base", "timeout": 300})
        assert status == 201, on_b
        status, made = await a.call("POST", "/sandboxes", {"templateID": "base", "timeout": 300})
        assert status == 201, made
        sid, token = made["sandboxID"], made["envdAccessToken"]
        if sid in b.manager.records:  # placement put it on b: name the nodes by their part from here on
            a, b = b, a
        assert sid in a.manager.records and sid not in b.manager.records
        for node in (a, b):  # a list through any node shows every node's sandboxes
            status, listed = await node.call("GET", "/v2/sandboxes")
            assert status == 200 and {x["sandboxID"] for x in listed} == {sid, on_b["sandboxID"]}

        status, info = await b.call("GET", f"/sandboxes/{sid}")  # the control plane, through b
        assert status == 200 and info["sandboxID"] == sid
        body = secrets.token_bytes(768 << 10)  # 768 KiB: streamed through, both ways
        await write_file(b, sid, token, "/home/user/through-b.bin", body)  # the data plane, through b
        assert await read_file(a, sid, token, "/home/user/through-b.bin") == body
        assert await read_file(b, sid, token, "/home/user/through-b.bin") == body
        async with b.http.get(f"{b.url}/sandboxes/{sid}", headers={**b.headers, "X-KeepState-Relayed": "c"}) as r:
            assert r.status == 421  # relayed here, but b does not hold it: the relaying node is to look again
        assert (await b.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204  # a command, through b
        assert (await a.call("GET", f"/sandboxes/{sid}"))[1]["state"] == "paused"
        assert (await b.call("POST", f"/sandboxes/{sid}/connect", {"timeout": 60}))[0] == 201  # resumed on a
        assert sid in a.manager.records and sid not in b.manager.records
        assert (await b.call("DELETE", f"/sandboxes/{sid}"))[0] == 204
        assert (await a.call("GET", f"/sandboxes/{sid}"))[0] == 404
