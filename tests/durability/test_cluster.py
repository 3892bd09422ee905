"""Three real nodes on one machine (docs/design/cluster.md): `keepstate serve --node` processes with real gVisor
sandboxes, one real PostgreSQL, one real SeaweedFS S3 store, the stock SDK as the client.

- A sandbox created through one node is used through another (commands, files, a port URL), wherever placement put
  it; list and info agree on every node.
- Paused through a second node, its owner `kill -9`ed: a connect through a survivor resumes it there from the
  store, with its files and its processes (a counter that goes on counting).
- Running under a checkpoint policy, its owner `kill -9`ed: a survivor resumes it from its latest checkpoint
  without being asked, and its history states the loss window and still verifies.

The nodes' leases are 3 s (`--lease-ttl 3`) so that a death is declared within seconds.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import PtySize, Sandbox

from keepstate.db.engine import Database
from keepstate.db.records import SandboxRecord
from keepstate.db.repos import Nodes, Sandboxes
from keepstate.testing.databases import require_postgres
from keepstate.testing.postgres import PostgresServer
from tests.sdk.sdkharness import KEEPSTATE, Server, free_port, wait_until
from tests.store.conftest import S3Server

from .conftest import Fleet, keepstate_env, sdk_opts
from .test_crash import count, counting

DOMAIN = "cluster.keepstate.test"


@pytest.fixture
def pg() -> Iterator[PostgresServer]:
    require_postgres()
    with PostgresServer() as server:
        yield server


def row(db: str, sandbox_id: str) -> SandboxRecord | None:
    async def read() -> SandboxRecord | None:
        database = Database.connect(db)
        try:
            return await Sandboxes(database).get(sandbox_id)
        finally:
            await database.close()

    return asyncio.run(read())


def node_state(db: str, node: str) -> str:
    async def read() -> str:
        database = Database.connect(db)
        try:
            found = await Nodes(database).get(node)
            return found.state if found is not None else "none"
        finally:
            await database.close()

    return asyncio.run(read())


def start_nodes(fleet: Fleet, db: str, store: str, names: tuple[str, ...]) -> dict[str, Server]:
    nodes = {}
    for name in names:
        port = free_port()
        nodes[name] = fleet.start(port=port, db=db, store=store, extra=(
            "--node", name, "--advertise", f"http://127.0.0.1:{port}", "--lease-ttl", "3", "--domain", DOMAIN,
            "--warm", "base"))
    return nodes


def events(srv: Server, db: str, sandbox_id: str) -> list[dict[str, object]]:
    out = subprocess.run([str(KEEPSTATE), "events", sandbox_id, "--json"], capture_output=True, text=True,
                         env={**keepstate_env(srv), "KEEPSTATE_DB": db}, timeout=300, check=True).stdout
    found = json.loads(out)
    return list(found["events"] if isinstance(found, dict) else found)


def verified(srv: Server, db: str, sandbox_id: str) -> bool:
    done = subprocess.run([str(KEEPSTATE), "events", sandbox_id, "--verify"], capture_output=True, text=True,
                          env={**keepstate_env(srv), "KEEPSTATE_DB": db}, timeout=300)
    return done.returncode == 0


def port_get(srv: Server, sandbox_id: str, port: int, path: str) -> bytes:
    request = urllib.request.Request(srv.url + path, headers={"Host": f"{port}-{sandbox_id}.{DOMAIN}"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return bytes(answer.read())


def test_three_gvisor_nodes_any_node_answers_and_sessions_outlive_their_node(
        fleet: Fleet, pg: PostgresServer, s3_server: S3Server) -> None:
    db = pg.createdb("cluster")
    nodes = start_nodes(fleet, db, s3_server.url("cluster"), ("a", "b", "c"))
    key = nodes["a"].key
    for srv in nodes.values():
        srv.key = key  # one API key for the whole cluster (the database is one)

    # Created through a, used through c: commands, files, a PTY, a port URL (relayed to the owner if it is not c).
    sbx = Sandbox.create(timeout=600, **sdk_opts(nodes["a"]))
    sid = sbx.sandbox_id
    owner = row(db, sid).node_id  # type: ignore[union-attr]
    through_c = Sandbox.connect(sid, **sdk_opts(nodes["c"]))
    assert through_c.commands.run("echo through c").stdout.strip() == "through c"
    through_c.files.write("/home/user/kept.txt", "across nodes")
    assert sbx.files.read("/home/user/kept.txt") == "across nodes"
    pty = through_c.pty.create(PtySize(rows=24, cols=80))  # a Connect stream both ways, over the hop
    through_c.pty.send_stdin(pty.pid, b"tty; exit 0\n")
    out = bytearray()
    assert pty.wait(on_pty=lambda data: out.extend(data)).exit_code == 0
    assert b"/dev/pts/" in out
    through_c.commands.run("cd /home/user && python3 -m http.server 8000 >/dev/null 2>&1", background=True)
    wait_until(lambda: _answers(nodes["c"], sid), 30, "the sandbox's port 8000 through c")
    assert port_get(nodes["c"], sid, 8000, "/kept.txt") == b"across nodes"
    for srv in nodes.values():  # list and info agree on every node
        assert sid in {s.sandbox_id for s in Sandbox.list(**sdk_opts(srv)).next_items()}
        assert Sandbox.get_info(sid, **sdk_opts(srv)).sandbox_id == sid

    # Paused through another node than its owner; the owner is killed; a survivor resumes it, processes and all.
    counting(through_c)
    others = [n for n in nodes if n != owner]
    Sandbox.connect(sid, **sdk_opts(nodes[others[0]])).pause()
    before = row(db, sid)
    assert before is not None and (before.node_id, before.state) == (owner, "paused")
    fleet.sigkill(nodes[owner])
    wait_until(lambda: node_state(db, owner) == "dead", 60, f"node {owner} to be declared dead")
    resumed = Sandbox.connect(sid, timeout=600, **sdk_opts(nodes[others[1]]))
    moved = row(db, sid)
    assert moved is not None and moved.node_id in others and moved.epoch == before.epoch + 1
    assert resumed.files.read("/home/user/kept.txt") == "across nodes"
    first = count(resumed)
    wait_until(lambda: count(resumed) > first, 30, "the counter to go on counting after the move")
    kinds = [e["kind"] for e in events(nodes[others[1]], db, sid)]
    assert "sandbox.node.moved" in kinds
    assert verified(nodes[others[1]], db, sid)

    # Running under a 2 s checkpoint policy on a survivor, which is then killed: the last node resumes it, unasked.
    rid = _create(nodes[moved.node_id], checkpoint_every=2)
    host = row(db, rid).node_id  # type: ignore[union-attr]  # wherever placement put it
    last = next(n for n in others if n != host)
    running = Sandbox.connect(rid, **sdk_opts(nodes[host]))
    running.files.write("/home/user/policy.txt", "checkpointed")
    counting(running)
    started = time.time()
    wait_until(lambda: _checkpoint_at(db, rid) > started, 60, "a policy checkpoint with the counter running")
    fleet.sigkill(nodes[host])
    wait_until(lambda: (r := row(db, rid)) is not None and r.node_id == last and r.state == "running", 90,
               f"node {last} to take the running sandbox over")
    again = Sandbox.connect(rid, **sdk_opts(nodes[last]))
    assert again.files.read("/home/user/policy.txt") == "checkpointed"
    first = count(again)
    wait_until(lambda: count(again) > first, 30, "the restored counter to go on")
    history = events(nodes[last], db, rid)
    lost = [e["data"] for e in history if e["kind"] == "sandbox.node.lost"]
    assert len(lost) == 1 and lost[0]["node"] == host and lost[0]["lostSeconds"] is not None  # type: ignore[index]
    assert verified(nodes[last], db, rid)
    again.kill()  # the rest go with their servers (--reap-on-exit), or as leftovers of the killed ones


def _answers(srv: Server, sandbox_id: str) -> bool:
    try:
        port_get(srv, sandbox_id, 8000, "/")
        return True
    except OSError:
        return False


def _create(srv: Server, checkpoint_every: int) -> str:
    """A sandbox with our `checkpointEvery` (a field the SDK does not send): created with a plain request."""
    body = json.dumps({"templateID": "base", "timeout": 600, "checkpointEvery": checkpoint_every}).encode()
    request = urllib.request.Request(srv.url + "/sandboxes", data=body, method="POST", headers={
        "X-API-KEY": srv.key, "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return str(json.loads(answer.read())["sandboxID"])


def _checkpoint_at(db: str, sandbox_id: str) -> float:
    found = row(db, sandbox_id)
    return float(json.loads(found.doc).get("checkpoint_at") or 0) if found is not None else 0.0


def test_a_node_frozen_past_its_lease_does_not_run_or_write_for_a_session_that_moved(
        fleet: Fleet, pg: PostgresServer, s3_server: S3Server) -> None:
    """SIGSTOP of a node's server past its lease, then SIGCONT: another node resumed its running sandbox from the
    checkpoint policy's latest checkpoint meanwhile; the node that comes back finds its incarnation gone, has its
    writes for the session refused, destroys its own instance of it and rejoins. The session runs in one place."""
    from keepstate.runtime.gvisor import GVisorRuntime

    db = pg.createdb("frozen")
    nodes = start_nodes(fleet, db, s3_server.url("frozen"), ("a", "b"))
    nodes["b"].key = nodes["a"].key
    sid = _create(nodes["a"], checkpoint_every=1)
    before = row(db, sid)
    assert before is not None
    frozen, other = before.node_id, next(n for n in nodes if n != before.node_id)
    sbx = Sandbox.connect(sid, **sdk_opts(nodes[frozen]))
    sbx.files.write("/home/user/one-place.txt", "here")
    counting(sbx)
    started = time.time()
    wait_until(lambda: _checkpoint_at(db, sid) > started, 60, "a policy checkpoint with the counter running")
    instance = row(db, sid).runtime_name  # type: ignore[union-attr]
    server = nodes[frozen].proc
    assert server is not None
    server.send_signal(signal.SIGSTOP)  # the server only: its sandbox's runsc processes are not stopped
    try:
        wait_until(lambda: (r := row(db, sid)) is not None and r.node_id == other and r.state == "running", 90,
                   f"node {other} to take the sandbox over from the frozen node")
    finally:
        server.send_signal(signal.SIGCONT)
    moved = row(db, sid)
    assert moved is not None and moved.epoch == before.epoch + 1
    runtime = GVisorRuntime(Path(nodes[frozen].home) / "sandboxes")
    wait_until(lambda: runtime.state(instance) in ("gone", "stopped"), 60,
               f"node {frozen} to destroy its instance of the moved sandbox")
    wait_until(lambda: _incarnation(db, frozen) >= 2, 60, f"node {frozen} to rejoin as a new incarnation")
    after = row(db, sid)
    assert after is not None and (after.node_id, after.epoch) == (other, moved.epoch)  # nothing written by it
    history = events(nodes[other], db, sid)
    kinds = [e["kind"] for e in history]
    moved_at = kinds.index("sandbox.node.moved")
    assert "sandbox.node.lost" in kinds[:moved_at]
    assert verified(nodes[other], db, sid)
    again = Sandbox.connect(sid, **sdk_opts(nodes[frozen]))  # through the node that came back: relayed
    assert again.files.read("/home/user/one-place.txt") == "here"
    first = count(again)
    wait_until(lambda: count(again) > first, 30, "the counter to run on, in one place")
    again.kill()


def _incarnation(db: str, node: str) -> int:
    async def read() -> int:
        database = Database.connect(db)
        try:
            found = await Nodes(database).get(node)
            return found.incarnation if found is not None and found.state == "alive" else 0
        finally:
            await database.close()

    return asyncio.run(read())


def test_a_template_built_on_one_node_makes_sandboxes_on_another(
        fleet: Fleet, pg: PostgresServer, s3_server: S3Server) -> None:
    """`Template.build` through node a (its build sandbox runs on a; the template's checkpoint goes to the shared
    store, its record to the shared database); a is drained; a create from the template through a lands on b and
    has what the build put there."""
    import secrets

    from e2b import Template

    db = pg.createdb("built")
    nodes = start_nodes(fleet, db, s3_server.url("built"), ("a", "b"))
    key = nodes["b"].key = nodes["a"].key
    name = f"cross-node-{secrets.token_hex(4)}"
    built = Template().from_template("base").run_cmd("echo built on a > /home/user/origin.txt")
    Template.build(built, name, cpu_count=1, memory_mb=1024, api_key=key, api_url=nodes["a"].url)

    async def drain() -> None:
        database = Database.connect(db)
        try:
            assert await Nodes(database).drain("a")
        finally:
            await database.close()

    asyncio.run(drain())
    sbx = Sandbox.create(name, timeout=120, **sdk_opts(nodes["a"]))  # placed: a takes no creates now
    assert row(db, sbx.sandbox_id).node_id == "b"  # type: ignore[union-attr]
    assert sbx.files.read("/home/user/origin.txt").strip() == "built on a"
    sbx.kill()
