"""Loss of a node (docs/design/cluster.md, "Loss of a node", "Fencing"): a running sandbox under a checkpoint policy
whose node dies resumes on another node from its latest checkpoint, the work since lost and said so in its history;
the dead node's sandboxes are held still while it is fenced, and when it comes back it destroys what it no longer
owns and writes nothing for it (its history appends and row writes refused by epoch). No two nodes run one session.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keepstate.api.nodes import MEMBERSHIP
from keepstate.db.errors import Fenced
from keepstate.db.repos import Nodes, Sandboxes
from keepstate.sandbox.instances import handle_of
from keepstate.testing import FakeRuntime
from keepstate.testing.databases import postgres  # noqa: F401
from keepstate.testing.postgres import PostgresServer

from ..sandbox.conftest import Served, serving
from ..sandbox.test_races import read_file, write_file

LEASE = (1.0, 0.1, 0.4)  # TTL, renewal, fence margin: a node declared dead within seconds


async def until(check: Callable[[], Any], what: str, seconds: float = 30.0) -> None:
    """Until `check()` (a plain or an async predicate) holds; TimeoutError naming `what` after `seconds`."""
    async def holds() -> bool:
        value = check()
        return bool(await value if inspect.isawaitable(value) else value)

    try:
        async with asyncio.timeout(seconds):
            while not await holds():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise TimeoutError(f"gave up after {seconds:g} s waiting for {what}") from None


async def declared_dead(s: Served, node: str) -> None:
    """Until `s`'s reaper has declared `node` dead."""
    nodes = Nodes(s.manager.db)

    async def dead() -> bool:
        found = await nodes.get(node)
        return found is not None and found.state == "dead"

    await until(dead, f"{node} declared dead")


async def checkpointed(s: Served, sid: str) -> float:
    """Wait for the checkpoint policy's next checkpoint of `sid`; when it was taken."""
    before = s.manager.records[sid].settings.checkpoint_at

    async def taken() -> bool:
        return s.manager.records[sid].settings.checkpoint_at > before

    await until(taken, "a policy checkpoint")
    return s.manager.records[sid].settings.checkpoint_at


async def cut_off(a: Served) -> None:
    """a hangs: its renewals never reach the database (a node frozen, or cut off from it)."""
    assert a.app is not None

    async def never() -> None:
        pass

    a.app[MEMBERSHIP].renew_once = never


async def test_a_running_session_survives_its_node_from_its_latest_checkpoint(
        postgres: PostgresServer, tmp_path: Path) -> None:  # noqa: F811
    url = postgres.createdb(f"lost_{secrets.token_hex(6)}")
    store = f"file://{tmp_path / 'store'}"
    runtime = FakeRuntime()  # a's host: looked at after a is cut off
    try:
        async with contextlib.AsyncExitStack() as stack:
            a = await stack.enter_async_context(serving(node="a", db_url=url, store_url=store, lease=LEASE,
                                                        runtime=runtime, reap_on_exit=False, pool_size=0))
            status, made = await a.call("POST", "/sandboxes", {"templateID": "base", "timeout": 600,
                                                               "checkpointEvery": 1})
            assert status == 201, made
            sid, token = made["sandboxID"], made["envdAccessToken"]
            await write_file(a, sid, token, "/home/user/kept.txt", b"before the checkpoint")
            at = await checkpointed(a, sid)
            a.manager.policy.every = 0
            a.manager.records[sid].settings.checkpoint_every = 0  # no checkpoint after this one: the rest is lost
            await write_file(a, sid, token, "/home/user/lost.txt", b"after the checkpoint")
            instance = a.manager.records[sid].runtime_name
            before = await Sandboxes(a.manager.db).get(sid)
            assert before is not None and (before.node_id, before.state) == ("a", "running")

            await cut_off(a)
            b = await stack.enter_async_context(serving(node="b", db_url=url, store_url=store, key=a.key,
                                                        lease=LEASE, pool_size=0))

            async def on_b() -> bool:
                row = b.manager.table.find(sid)
                return row is not None and row.state == "running"

            await until(on_b, "the take-over")  # nobody called it: b's loop found it lost and resumed it
            assert a.app is not None and a.app[MEMBERSHIP].fenced is not None  # a fenced itself before that
            # a's instance was held still (frozen) from the fence on: it ran nothing while b took over.
            assert runtime.idle_frozen(handle_of(a.manager.records[sid])) or \
                runtime.statuses().get(instance, "gone") == "gone"

            moved = await Sandboxes(b.manager.db).get(sid)
            assert moved is not None and (moved.node_id, moved.epoch) == ("b", before.epoch + 1)
            assert await read_file(b, sid, token, "/home/user/kept.txt") == b"before the checkpoint"
            assert not await exists(b, sid, token, "/home/user/lost.txt")  # written after the checkpoint: lost
            events = b.manager.recorder.events
            history = await events.read(sid)
            lost = [e.data for e in history if e.kind == "sandbox.node.lost"]
            assert len(lost) == 1, [e.kind for e in history]
            assert lost[0]["node"] == "a" and lost[0]["state"] == "running"
            assert lost[0]["checkpointAt"] == pytest.approx(at) and lost[0]["lostSeconds"] >= 0
            assert lost[0]["lastEvent"]["seq"] >= 1
            assert [e.kind for e in history].index("sandbox.node.lost") < [e.kind for e in history].index(
                "sandbox.node.moved")
            assert (await events.verify(sid)).ok  # the chain verifies across the move

            # a's last view of the sandbox is refused, row and history alike: it cannot write for a moved session.
            with pytest.raises(Fenced):
                await Sandboxes(a.manager.db).transition(sid, before.version, before.epoch, state="running")
            with pytest.raises(Fenced):
                await a.manager.recorder.record(sid, "written.by.the.old.owner")
            assert "written.by.the.old.owner" not in [e.kind for e in await events.read(sid)]

            # a comes back: its incarnation is gone, it destroys its instance of the moved sandbox, and rejoins.
            del a.app[MEMBERSHIP].renew_once
            await until(lambda: a.app is not None and a.app[MEMBERSHIP].fenced is None, "a rejoins")
            assert sid not in a.manager.records
            assert runtime.statuses().get(instance, "gone") in ("gone", "stopped")
            node_a = await Nodes(b.manager.db).get("a")
            assert node_a is not None and node_a.state == "alive" and node_a.incarnation >= 2
            again = await Sandboxes(b.manager.db).get(sid)  # b's row untouched by a's clean-up
            assert again is not None and (again.node_id, again.epoch) == ("b", before.epoch + 1)
            assert await read_file(a, sid, token, "/home/user/kept.txt") == b"before the checkpoint"  # relayed
    finally:
        runtime.close()


async def exists(s: Served, sid: str, token: str, path: str) -> bool:
    async with s.http.get(f"{s.url}/files", params={"path": path, "username": "user"},
                          headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token}) as r:
        assert r.status in (200, 404), await r.text()
        return r.status == 200


async def test_a_running_sandbox_without_a_checkpoint_is_declared_lost(postgres: PostgresServer,  # noqa: F811
                                                                        tmp_path: Path) -> None:
    url = postgres.createdb(f"lost_{secrets.token_hex(6)}")
    store = f"file://{tmp_path / 'store'}"
    async with serving(node="a", db_url=url, store_url=store, lease=LEASE, pool_size=0) as a:
        status, made = await a.call("POST", "/sandboxes", {"templateID": "base", "timeout": 600})
        assert status == 201, made
        sid = made["sandboxID"]
        await cut_off(a)
        async with serving(node="b", db_url=url, store_url=store, key=a.key, lease=LEASE, pool_size=0) as b:
            rows = Sandboxes(b.manager.db)

            async def gone() -> bool:
                return await rows.get(sid) is None

            await until(gone, "the lost sandbox's row to go")

            async def said() -> bool:  # recorded right after the row went
                return [e.kind for e in await b.manager.recorder.events.read(sid)][-1] == "sandbox.lost"

            await until(said, "its history to say it is lost")
            status, _ = await b.call("GET", f"/sandboxes/{sid}")
            assert status == 404


async def test_a_fenced_node_holds_its_sandboxes_still_and_releases_them_when_it_renews(
        postgres: PostgresServer) -> None:  # noqa: F811
    url = postgres.createdb(f"lost_{secrets.token_hex(6)}")
    async with serving(node="a", db_url=url, lease=LEASE, pool_size=0) as a:
        status, made = await a.call("POST", "/sandboxes", {"templateID": "base", "timeout": 600})
        assert status == 201, made
        sid = made["sandboxID"]
        handle = handle_of(a.manager.records[sid])
        assert a.app is not None
        membership = a.app[MEMBERSHIP]
        detached: list[int] = []
        egress = a.manager.egress
        real_detach = egress.detach

        def detach(slot: int, *args: Any) -> None:
            detached.append(slot)
            real_detach(slot, *args)

        egress.detach = detach  # type: ignore[method-assign]
        await cut_off(a)
        await until(lambda: membership.fenced is not None, "the fence")
        await until(lambda: a.manager.runtime.idle_frozen(handle), "the freeze")
        assert a.manager.records[sid].slot in detached  # its egress cut
        status, _ = await a.call("GET", f"/sandboxes/{sid}")
        assert status == 503  # a fenced node serves nothing for its sandboxes
        del membership.renew_once  # the same incarnation renews in time: nothing was taken from it
        await until(lambda: membership.fenced is None, "the fence lifted")
        await until(lambda: not a.manager.runtime.idle_frozen(handle), "the thaw")
        status, info = await a.call("GET", f"/sandboxes/{sid}")
        assert status == 200 and info["state"] == "running"


async def test_a_request_on_the_data_plane_takes_a_paused_sandbox_of_a_dead_node_over(
        postgres: PostgresServer, tmp_path: Path) -> None:  # noqa: F811
    """A port URL or agent request through b for a paused sandbox of a node that died: b takes it over (it is b's,
    paused, from then on) and answers as for its own paused sandbox; with autoResume the request resumes it."""
    url = postgres.createdb(f"lost_{secrets.token_hex(6)}")
    store = f"file://{tmp_path / 'store'}"
    async with serving(node="a", db_url=url, store_url=store, lease=LEASE, pool_size=0) as a:
        status, made = await a.call("POST", "/sandboxes", {"templateID": "base", "timeout": 600, "autoPause": True,
                                                           "autoResume": {"enabled": True}})
        assert status == 201, made
        sid, token = made["sandboxID"], made["envdAccessToken"]
        await write_file(a, sid, token, "/home/user/woken.txt", b"by its traffic")
        assert (await a.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204
        await cut_off(a)
        async with serving(node="b", db_url=url, store_url=store, key=a.key, lease=LEASE, pool_size=0) as b:
            await declared_dead(b, "a")
            assert sid not in b.manager.records  # nobody asked for it yet: paused ones move on demand
            assert await read_file(b, sid, token, "/home/user/woken.txt") == b"by its traffic"
            row = await Sandboxes(b.manager.db).get(sid)
            assert row is not None and (row.node_id, row.state) == ("b", "running")
            kinds = [e.kind for e in await b.manager.recorder.events.read(sid)]
            assert "sandbox.node.moved" in kinds and "sandbox.node.lost" not in kinds


async def test_an_owner_that_does_not_answer_gets_a_503_to_retry_not_a_502(postgres: PostgresServer) -> None:  # noqa: F811
    """Between a node's death and its lease's end, a request for its sandbox through another node cannot be relayed
    and cannot be taken over yet: the answer says retry (503, Retry-After, Should-Retry), nothing of it having been
    sent anywhere."""
    from keepstate.api.relay import RELAY, Owner

    url = postgres.createdb(f"lost_{secrets.token_hex(6)}")
    async with serving(node="a", db_url=url, lease=LEASE, pool_size=0) as a, \
            serving(node="b", db_url=url, key=a.key, lease=LEASE, pool_size=0) as b:
        status, made = await a.call("POST", "/sandboxes", {"templateID": "base", "timeout": 600})
        assert status == 201, made
        sid = made["sandboxID"]
        holder, other = (a, b) if sid in a.manager.records else (b, a)
        assert other.app is not None
        relay = other.app[RELAY]
        silent = Owner(holder.manager.rows.node_id, "http://127.0.0.1:9", 0)  # the discard port: refused

        async def owner(sandbox_id: str) -> Owner | None:
            return silent

        relay.owner = owner  # type: ignore[method-assign]
        async with other.http.get(f"{other.url}/sandboxes/{sid}", headers=other.headers) as r:
            body = await r.json()
            assert r.status == 503 and r.headers["Should-Retry"] == "true" and int(r.headers["Retry-After"]) >= 1
            assert body["code"] == 503 and holder.manager.rows.node_id in body["message"]


async def test_a_draining_node_hands_its_paused_sessions_to_the_others(postgres: PostgresServer,  # noqa: F811
                                                                       tmp_path: Path) -> None:
    """`keepstate nodes drain a`: a's paused sandboxes (their standbys released: the checkpoints are in the store)
    become b's, epoch moved on, and resume on b with their files; a's running one stays a's and is served."""
    url = postgres.createdb(f"lost_{secrets.token_hex(6)}")
    store = f"file://{tmp_path / 'store'}"
    async with serving(node="a", db_url=url, store_url=store, lease=LEASE, pool_size=0) as a:
        made = []
        for _ in range(3):
            status, body = await a.call("POST", "/sandboxes", {"templateID": "base", "timeout": 600})
            assert status == 201, body
            made.append((body["sandboxID"], body["envdAccessToken"]))
        (paused, token), _, (running, _) = made
        await write_file(a, paused, token, "/home/user/drained.txt", b"handed over")
        assert (await a.call("POST", f"/sandboxes/{paused}/pause"))[0] == 204
        assert (await a.call("POST", f"/sandboxes/{made[1][0]}/pause"))[0] == 204
        assert a.manager.records[paused].settings.standby is not None  # a frozen standby on a's host
        async with serving(node="b", db_url=url, store_url=store, key=a.key, lease=LEASE, pool_size=0) as b:
            rows = Sandboxes(b.manager.db)
            before = await rows.get(paused)
            assert await Nodes(b.manager.db).drain("a")

            async def handed() -> bool:
                found = [await rows.get(sid) for sid, _ in made[:2]]
                return all(r is not None and r.node_id == "b" for r in found)

            await until(handed, "a's paused sandboxes to become b's")
            assert paused not in a.manager.records and not a.manager.standbys.ids()
            moved = await rows.get(paused)
            assert moved is not None and before is not None and moved.epoch == before.epoch + 1
            assert (await rows.get(running)).node_id == "a"  # type: ignore[union-attr]
            status, info = await b.call("GET", f"/sandboxes/{made[1][0]}")  # b answers for it, loaded from its row
            assert status == 200 and info["state"] == "paused"
            # Through a (which relays now) or b: it resumes on b, files and all.
            status, _ = await a.call("POST", f"/sandboxes/{paused}/connect", {"timeout": 60})
            assert status == 201
            assert paused in b.manager.records and b.manager.records[paused].state == "running"
            assert await read_file(a, paused, token, "/home/user/drained.txt") == b"handed over"
            reasons = [e.data.get("reason") for e in await b.manager.recorder.events.read(paused)
                       if e.kind == "sandbox.node.moved"]
            assert reasons == ["drain"]
            assert (await b.manager.recorder.events.verify(paused)).ok
            status, info = await a.call("GET", f"/sandboxes/{running}")  # a still serves what runs on it
            assert status == 200 and info["state"] == "running"


async def test_a_node_stopping_with_on_stop_handover_has_its_sandboxes_resumed_at_once_elsewhere(
        postgres: PostgresServer, tmp_path: Path) -> None:  # noqa: F811
    url = postgres.createdb(f"lost_{secrets.token_hex(6)}")
    store = f"file://{tmp_path / 'store'}"
    async with contextlib.AsyncExitStack() as on_a:
        a = await on_a.enter_async_context(serving(node="a", db_url=url, store_url=store, lease=LEASE, pool_size=0,
                                                   on_stop="handover"))
        status, made = await a.call("POST", "/sandboxes", {"templateID": "base", "timeout": 600})
        assert status == 201, made
        sid, token = made["sandboxID"], made["envdAccessToken"]
        await write_file(a, sid, token, "/home/user/handed.txt", b"resumed at once")
        async with serving(node="b", db_url=url, store_url=store, key=a.key, lease=LEASE, pool_size=0) as b:
            await on_a.aclose()  # SIGTERM: paused, handed to b, and a leaves

            async def running_on_b() -> bool:
                row = b.manager.table.find(sid)
                return row is not None and row.state == "running"

            await until(running_on_b, "b to resume the handed-over sandbox, unasked")
            assert await read_file(b, sid, token, "/home/user/handed.txt") == b"resumed at once"
            row = await Sandboxes(b.manager.db).get(sid)
            assert row is not None and row.node_id == "b" and not row.resume_pending
            moves = [e.data for e in await b.manager.recorder.events.read(sid) if e.kind == "sandbox.node.moved"]
            assert [(m["from"], m["to"], m.get("reason")) for m in moves] == [("a", "b", "handover")]


async def test_a_node_that_cannot_resume_a_checkpoint_does_not_take_it_over(postgres: PostgresServer,  # noqa: F811
                                                                           tmp_path: Path) -> None:
    """A resume needs the runsc release and the CPU features the checkpoint was taken under: a node with another
    release refuses (503 `sandbox_no_compatible_node`) and leaves the sandbox for a compatible node."""
    import sqlalchemy as sa

    from keepstate.db.schema import nodes as nodes_table

    url = postgres.createdb(f"lost_{secrets.token_hex(6)}")
    store = f"file://{tmp_path / 'store'}"
    async with serving(node="a", db_url=url, store_url=store, lease=LEASE, pool_size=0) as a:
        status, made = await a.call("POST", "/sandboxes", {"templateID": "base", "timeout": 600})
        assert status == 201, made
        sid = made["sandboxID"]
        assert (await a.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204
        await cut_off(a)
        async with serving(node="b", db_url=url, store_url=store, key=a.key, lease=LEASE, pool_size=0) as b:
            async with b.manager.db.transaction() as conn:  # a's checkpoints were taken under another runsc
                await conn.execute(sa.update(nodes_table).where(nodes_table.c.node_id == "a")
                                   .values(runsc_release="release-of-another-day"))
            await declared_dead(b, "a")
            status, body = await b.call("POST", f"/sandboxes/{sid}/connect", {"timeout": 60})
            assert status == 503 and body["error_code"] == "sandbox_no_compatible_node", body
            assert "release-of-another-day" in body["message"]
            row = await Sandboxes(b.manager.db).get(sid)
            assert row is not None and row.node_id == "a"  # left for a compatible node
