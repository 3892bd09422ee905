"""One listener for the control plane and the data-plane router.

Dispatch is by headers, not paths (paths collide: /health exists on the API, the agent and
the code interpreter): a request naming a sandbox goes to the router, anything else to the
REST API. Every error leaves as JSON {"code", "message"}.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from keepstate import netaddr
from keepstate.apikeys import find as find_key
from keepstate.builds.service import TemplateBuilds
from keepstate.builds.uploads import PREFIX as UPLOAD_PREFIX
from keepstate.cluster.membership import FENCE_MARGIN_S, RENEW_S, TTL_S, Membership
from keepstate.config import DEFAULT_DISK_MB
from keepstate.db import setup as db_setup
from keepstate.db.engine import Database
from keepstate.db.records import NodeRecord
from keepstate.db.repos import History, Keys, Nodes
from keepstate.db.repos.ledger_claims import node_owner
from keepstate.db.setup import LOCAL_NODE
from keepstate.egress import firewall
from keepstate.egress.service import Egress, EgressConfig
from keepstate.errors import Busy, KeepStateError, NotFound, Unauthorized
from keepstate.ports import AGENT_PORT, API_PORT, GATEWAY_PORT
from keepstate.runtime.base import Runtime
from keepstate.sandbox import loops as sandbox_loops
from keepstate.sandbox import recovery
from keepstate.sandbox.admission import AdmissionConfig
from keepstate.sandbox.creates import MAX_TIMEOUT
from keepstate.sandbox.durable import Durability
from keepstate.sandbox.fencing import FenceHold
from keepstate.sandbox.manager import SandboxManager
from keepstate.sandbox.retention import RETENTION_EVERY, Retention
from keepstate.sandbox.templates import BuiltTemplates, Templates
from keepstate.secret import SecretStore
from keepstate.secret.crypto import KEY_FILE, Sealer
from keepstate.session import EventLog, JournalPoller, Lineage, SessionRecorder
from keepstate.volume import Volumes
from keepstate.volume.store import DEFAULT_SIZE_MB

from . import control, events, logs
from . import nodes as nodes_api
from . import secrets as secret_routes
from . import template_builds as build_routes
from . import templates as template_routes
from . import volumes as volume_routes
from .idempotent import IdempotentCreates
from .keys import (
    API_KEY_ID,
    DATABASE,
    DOMAIN,
    ENVD_VERSION,
    IDEMPOTENT,
    MANAGER,
    RETENTION,
    SECRETS,
    TIMEOUT_LIMIT,
    VOLUMES,
)
from .placement import CREATE_PATHS, PLACER, Placer, is_create
from .relay import RELAY, RELAYED, Relay
from .router import DataPlane, Router, is_data_plane, target_of
from .spec import Spec, validating_middleware

log = logging.getLogger("keepstate.api")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_JSON_BODY = 1 << 20


@dataclass
class ServerConfig:
    home: Path
    host: str = "127.0.0.1"
    port: int = API_PORT
    pool_size: int = 2
    template_pool_size: int = 1  # built templates' pools (sandbox/creates.py)
    warm_templates: tuple[str, ...] = ("base",)
    open_ports: tuple[int, ...] = field(default_factory=tuple)
    reap_on_exit: bool = False
    store_url: str | None = None  # default file://<home>/store; s3://bucket/prefix?endpoint=... to share
    gateway_config: Path | None = None  # a GatewayConfig file: serve the metering gateway too
    gateway_port: int = GATEWAY_PORT
    disk_mb: int = DEFAULT_DISK_MB  # a sandbox's disk quota when its template names none
    standby_seconds: int = 300  # a paused sandbox stays frozen in memory this long (a resume is then a thaw)
    standby_mb: int = 2048  # memory all standbys together may hold
    freeze_idle_after: float = 2.0  # seconds without a call before an idle sandbox is frozen; 0: never
    runtime: str = "gvisor"  # or "fake": keepstate.testing.FakeRuntime, no isolation (tests only)
    volume_size_mb: int = DEFAULT_SIZE_MB  # a new volume's quota unless its create says (docs/design/volumes.md)
    volume_backend: str = "ext4"  # one loop-mounted ext4 image per volume; "dir": plain directories
    boot_images: bool = True  # restore new sandboxes from a checkpoint of a fresh boot (sandbox/boot_images.py)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # start queue and limits (admission.md)
    egress: EgressConfig = field(default_factory=EgressConfig)  # sandboxes' way out (docs/design/network.md)
    # None: secret/crypto.py's load_key (<home>/secrets.key, KEEPSTATE_SECRETS_KEY). Never in a repr.
    secrets_key: bytes | None = field(default=None, repr=False)
    domain: str | None = None  # port URLs' <port>-<id>.<domain>; default localhost:<port> (api/listeners.py)
    db_url: str | None = None  # --db; None: $KEEPSTATE_DB, else sqlite under home (docs/design/database.md)
    node: str | None = None  # --node: this server is a node of a cluster (docs/design/cluster.md); None: "local"
    advertise: str | None = None  # --advertise: the URL other nodes reach it on; default http://<listen>
    checkpoint_every: int = 0  # --checkpoint-every: the server's checkpoint policy for running sandboxes (0: none)
    lease: tuple[float, float, float] = (TTL_S, RENEW_S, FENCE_MARGIN_S)  # the node's lease: TTL, renewal, margin
    # Lifetimes (docs/design/cluster.md, "Lifetimes and retention"). --max-timeout: the longest timeout a create,
    # connect, resume, fork or set-timeout may ask, seconds (E2B's Pro plan: 24 h; 0: no limit). --paused-retention:
    # seconds a sandbox stays paused before it and its pause checkpoints are deleted (None: kept forever), looked at
    # every `retention_every` seconds.
    max_timeout: int = MAX_TIMEOUT
    paused_retention: float | None = None
    retention_every: float = RETENTION_EVERY
    # --on-stop: "keep" (sandboxes run on; the next start re-adopts them), "pause" (each running sandbox paused to
    # the store and its standby released before the node leaves: another node resumes it at its next call) or
    # "handover" (paused, then handed to live nodes that resume it at once); None: "pause" for a node of a cluster,
    # else "keep"
    on_stop: str | None = None


def _envd_version() -> str:
    try:
        from keepstate.agent import ENVD_VERSION

        return str(ENVD_VERSION)
    except ImportError:
        return "0.6.13"


class KeyCache:
    """API keys checked against the database, remembered briefly so each request is cheap."""

    def __init__(self, keys: Keys, ttl: float = 5.0) -> None:
        self.keys = keys
        self.ttl = ttl
        self._seen: dict[str, tuple[float, str | None]] = {}

    async def check(self, key: str | None) -> str:
        if not key:
            raise Unauthorized("missing API key: send it in the X-API-KEY header (see `keepstate keys create`)")
        if not key.isascii():  # no key we issue is: and its bytes may not even encode
            raise Unauthorized("invalid API key")
        now = time.monotonic()
        hit = self._seen.get(key)
        if hit is None or hit[0] < now:
            found = await find_key(self.keys, key)
            hit = (now + self.ttl, found.id if found else None)
            self._seen[key] = hit
        if hit[1] is None:
            raise Unauthorized("invalid API key")
        return hit[1]


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error a REST handler raises, as the one JSON shape {"code", "message"} (a redirect passes)."""
    if "\x00" in request.path:  # no ID holds a NUL (the database refuses one): nothing it names exists
        return control.error_response(NotFound(f"nothing at {request.path[:200]!r}: an ID has no NUL character"))
    try:
        return await handler(request)
    except KeepStateError as exc:
        return control.error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None  # a 405 names the methods
        return web.json_response({"code": exc.status, "message": exc.reason}, status=exc.status, headers=allow)
    except Exception as exc:
        log.exception("unhandled error on %s %s", request.method, request.path)
        if request.method == "POST" and request.path in CREATE_PATHS:  # E2B: this node could not, this time: retry
            return web.json_response({"code": 500, "message": f"the sandbox could not be created: "
                                      f"{type(exc).__name__}: {exc}", "error_code": "sandbox_create_failed"},
                                     status=500, headers={"Should-Retry": "true"})
        return web.json_response({"code": 500, "message": f"internal error: {type(exc).__name__}: {exc}",
                                  "error_code": "internal_server_error"}, status=500, headers={"Should-Retry": "false"})


def runtime_for(config: ServerConfig) -> tuple[Runtime, Templates]:
    if config.runtime == "fake":
        from keepstate.testing import FakeRuntime, FakeTemplates

        return FakeRuntime(), FakeTemplates()
    from keepstate.runtime.gvisor import GVisorRuntime

    return GVisorRuntime(config.home / "sandboxes"), BuiltTemplates()


def create_app(config: ServerConfig, runtime: Runtime | None = None,
               templates: Templates | None = None) -> web.Application:
    db = Database.connect(config.db_url or db_setup.db_url(config.home))
    if runtime is None:
        runtime, default_templates = runtime_for(config)
        templates = templates or default_templates
    templates = templates or BuiltTemplates()
    envd_version = _envd_version()
    history = History(db)
    event_log, lineage = EventLog(history), Lineage(history)
    poller = JournalPoller(event_log, interval=1.0)
    recorder = SessionRecorder(event_log, lineage, poller)
    durable = Durability(config.home, runtime, templates, config.store_url)
    durable.clear_images()
    volumes = Volumes(config.home, db, config.volume_backend, config.volume_size_mb)
    secret_store = SecretStore(db, Sealer(config.secrets_key)) if config.secrets_key is not None else \
        SecretStore.open(db, config.home / KEY_FILE)
    gateway_app = gateway = None
    open_ports = tuple(config.open_ports)
    if config.gateway_config is not None:
        from keepstate.gateway import GatewayConfig
        from keepstate.gateway import create_app as create_gateway_app
        from keepstate.gateway.server import GATEWAY

        gw_config = GatewayConfig.from_file(config.gateway_config)
        gw_config.data_dir = config.home
        gw_config.forget_key_variables()  # read: no process the server starts (runsc, nft, ip...) inherits them
        gateway_app = create_gateway_app(gw_config, db)
        gateway = gateway_app[GATEWAY]
    node_id = config.node or LOCAL_NODE
    manager = SandboxManager(db, runtime, node_id=node_id, home=config.home, templates=templates, recorder=recorder,
                             durable=durable,
                             pool_size=config.pool_size, template_pool_size=config.template_pool_size,
                             host_name=socket.gethostname(), gateway=gateway,
                             gateway_url=f"http://{netaddr.GATEWAY_IP}:{config.gateway_port}" if gateway else None,
                             standby_seconds=config.standby_seconds, standby_mb=config.standby_mb,
                             disk_mb=config.disk_mb, volumes=volumes, admission=config.admission,
                             boot_images=config.boot_images, freeze_idle_after=config.freeze_idle_after,
                             secrets=secret_store,
                             egress=Egress(config.home, config.egress, datapath=config.runtime != "fake",
                                           secret_value=secret_store.value),
                             checkpoint_every=config.checkpoint_every)
    router = Router(manager)
    hold = FenceHold(manager)  # its lock keeps holds and releases in the order they were asked for
    in_order = manager.instances.in_background  # run after the membership's callback returns; drained at stop

    async def lost() -> None:
        await hold.reconcile()

    membership = Membership(
        Nodes(db), this_node(config, runtime, node_id), fencing=config.node is not None, ttl_s=config.lease[0],
        renew_s=config.lease[1], fence_margin_s=config.lease[2],
        metrics=lambda: {"sandboxes": len(manager.listed()), "teardowns": manager.teardowns_pending()},
        on_fence=lambda why: in_order(hold.hold()), on_unfence=lambda: in_order(hold.release()), on_lost=lost)
    if gateway is not None:  # its calls in flight are this node's incarnation's, judged by every node's gateway
        gateway.attach_node(node_id, lambda: membership.incarnation)
    if config.node is not None:  # a node writes a session's history only while it holds the sandbox's epoch
        history.fence = lambda session_id: fence_of(manager, session_id)
    manager.refusing = lambda: (f"node {node_id} is draining: it takes no new sandboxes (create through another node)"
                                if membership.state == "draining" else None)
    keys = KeyCache(Keys(db))
    relay = Relay(db, node_id)
    placer = Placer(db, node_id, relay.client, manager.places.room) if config.node is not None else None
    template_builds = TemplateBuilds(manager, db, config.home)
    retention = Retention(manager, config.paused_retention, config.retention_every)  # sandbox/retention.py
    retention.serving = lambda: membership.fenced is None

    async def to_router(request: web.Request) -> web.StreamResponse:
        target = target_of(request)
        if target is not None:
            return await router.handle(request, *target)
        row = router.match_signed_file(request)  # a signed /files URL (is_data_plane)
        if row is None:
            return web.json_response({"code": 401, "message": "invalid signature"}, status=401)
        return await router.handle(request, row.sandbox_id, AGENT_PORT)

    @web.middleware
    async def dispatch(request: web.Request, handler: Handler) -> web.StreamResponse:
        if membership.fenced is not None and (is_data_plane(request) or request.path not in UNFENCED):
            return control.error_response(Busy(f"node {node_id} is fenced ({membership.fenced}): it serves its "
                                               "sandboxes again once it renews its lease", retry_after=2))
        if is_data_plane(request):
            target = target_of(request)
            if target is not None and (relayed := await relay_to_owner(request, target[0])) is not None:
                return relayed
            return await to_router(request)
        # The content API authenticates with each volume's own token (api/volumes.py), never the API key.
        # A build context's upload URL carries its own signature (builds/uploads.py): the SDK sends no API key.
        if request.path != "/health" and not request.path.startswith(volume_routes.CONTENT_PREFIX) \
                and not (request.method == "PUT" and request.path.startswith(UPLOAD_PREFIX)):
            try:
                request[API_KEY_ID] = await keys.check(request.headers.get("X-API-KEY"))
            except KeepStateError as exc:
                return control.error_response(exc)
        if placer is not None and is_create(request) and (placed := await placer.place(request)) is not None:
            return placed
        sandbox_id = request.match_info.get("sandbox_id")
        if sandbox_id is not None and not request.path.endswith(HISTORY_PATHS) \
                and (relayed := await relay_to_owner(request, control.sid(request))) is not None:
            return relayed
        return await errors_as_json(request, handler)

    async def relay_to_owner(request: web.Request, sandbox_id: str) -> web.StreamResponse | None:
        """The owner's answer if another live node holds the sandbox (api/relay.py); None: this node answers."""
        held = manager.table.find(sandbox_id) is not None
        if RELAYED in request.headers:
            # Relayed here by a node that believed this one holds it (at the epoch it sends): if it does not, say so
            # before any body is read. One handed to this node by a draining one is loaded from its row first.
            if not held and config.node is not None:
                held = await recovery.load_own(manager, sandbox_id)
            seen = manager.rows.seen(sandbox_id)
            return relay.refusal(request, sandbox_id, held, seen[1] if seen is not None else None)
        if held:
            return None
        for last in (False, True):
            try:
                owner = await relay.owner(sandbox_id)
            except KeepStateError:  # the database is away: this node answers what it can
                return None
            if owner is None:  # this node's (loaded if a draining node handed it here), a gone node's, or none
                if config.node is not None and is_data_plane(request):
                    await recovery.on_request(manager, sandbox_id)  # a gone node's: taken over here
                elif config.node is not None:
                    await recovery.load_own(manager, sandbox_id)  # a gone node's: a connect or resume takes it
                return None
            answer = await relay.forward(request, owner, last=last)
            if answer is not None:
                return answer
            relay.forget(sandbox_id)  # misdirected: it moved since it was looked up
        return None

    # Outermost: with KEEPSTATE_VALIDATE_RESPONSES=1 every control-plane answer, errors included, is checked
    # against docs/openapi.yaml (tests run the server so).
    Spec.default()  # the contract request bodies are checked against: read now, not on the first request
    app = web.Application(middlewares=[validating_middleware(), dispatch], client_max_size=MAX_JSON_BODY,
                          handler_args={"max_field_size": 65536})
    app[MANAGER] = manager
    if placer is not None:
        app[PLACER] = placer
    app[IDEMPOTENT] = IdempotentCreates(db, manager, lambda: node_owner(node_id, membership.incarnation),
                                        control.recorded_answer(app))
    app[DATABASE] = db
    app[RELAY] = relay
    app[nodes_api.MEMBERSHIP] = membership
    app[ENVD_VERSION] = envd_version
    app[VOLUMES] = volumes
    app[SECRETS] = secret_store
    app[build_routes.BUILDS] = template_builds
    app[DOMAIN] = config.domain or f"localhost:{config.port}"
    app[TIMEOUT_LIMIT] = config.max_timeout
    app[RETENTION] = retention
    app[events.EVENTS] = event_log
    app[events.LINEAGE] = lineage
    # First: `DELETE /templates/{id}` deletes a built template, else hands over to control's snapshot delete, and
    # `/templates/tags` is not a template's ID.
    app.add_routes(build_routes.routes)
    app.add_routes(control.routes)
    app.add_routes(events.routes)
    app.add_routes(logs.routes)
    app.add_routes(template_routes.routes)
    app.add_routes(volume_routes.routes)
    app.add_routes(secret_routes.routes)
    app.add_routes(nodes_api.routes)
    app.router.register_resource(DataPlane(to_router))  # last: see DataPlane

    gateway_runner: list[web.AppRunner] = []

    membership_task: list[asyncio.Task[None]] = []

    async def on_startup(app: web.Application) -> None:
        await db_setup.upgrade(db, config.home, node_id)  # first: everything below reads it
        await membership.join()
        membership_task.append(asyncio.get_running_loop().create_task(membership.run(), name="membership"))
        if config.node is not None:
            membership_task.append(asyncio.get_running_loop().create_task(recovery.lost_loop(
                manager, config.lease[1], lambda: membership.fenced is None and membership.state == "alive",
                draining=lambda: membership.fenced is None and membership.state == "draining"),
                name="lost-sandboxes"))
        await secret_store.check_key()
        await template_builds.recover()
        await poller.start()
        if gateway_app is not None and config.runtime != "fake":
            await asyncio.to_thread(netaddr.ensure_gateway_address)
            runner = web.AppRunner(gateway_app, access_log=None)
            await runner.setup()
            for host in (netaddr.GATEWAY_IP, "127.0.0.1"):
                await web.TCPSite(runner, host, config.gateway_port).start()
            gateway_runner.append(runner)
            await asyncio.to_thread(firewall.open_service, "tcp", config.gateway_port)  # sandboxes may call it
        elif gateway is not None:  # not served (the fake runtime's sandboxes call nothing), but runs are registered
            await gateway.start()
        await volumes.mount_all()  # before adoption: sandboxes mount them
        await manager.start(open_ports=open_ports, warm=config.warm_templates)
        retention.start()  # with --paused-retention only

    async def on_cleanup(app: web.Application) -> None:
        await retention.stop()
        on_stop = config.on_stop or ("pause" if config.node else "keep")
        if on_stop in ("pause", "handover") and membership.fenced is None:
            running = frozenset(r.sandbox_id for r in manager.running())
            await sandbox_loops.pause_all(manager, f"the node stops (--on-stop {on_stop})")
            if on_stop == "handover" and config.node is not None:  # resumed at once by the nodes that get them
                await recovery.hand_over_paused(manager, resume=running)
        await poller.stop()  # first: its pulls go through the manager's AgentClient
        await template_builds.stop()
        await manager.stop(reap=config.reap_on_exit)
        if config.reap_on_exit:  # its sandboxes are gone: leave no loop mount behind (the data stays)
            await volumes.unmount_all()
        for runner in gateway_runner:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(firewall.close_service, "tcp", config.gateway_port)
            await runner.cleanup()
        if gateway is not None and not gateway_runner:
            await gateway.close()
        await router.stop()
        await relay.close()
        durable.close()
        for task in membership_task:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await membership.leave()
        await db.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


# A sandbox's history is the shared database's: any node answers for it without a hop.
HISTORY_PATHS = ("/events", "/lineage")
# Answered by a fenced node too: its health, and who is in the cluster.
UNFENCED = ("/health", "/nodes")


def fence_of(manager: SandboxManager, session_id: str) -> tuple[str, str, int] | None:
    """The claim this node writes a session's history under: its sandbox's row at the epoch this node holds."""
    row = manager.table.find(session_id)
    seen = manager.rows.seen(session_id) if row is not None and row.session_id == session_id else None
    return (session_id, manager.rows.node_id, seen[1]) if seen is not None else None


def this_node(config: ServerConfig, runtime: Runtime, node_id: str) -> NodeRecord:
    """What this server tells the cluster about itself when it joins."""
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
    return NodeRecord(node_id=node_id, address=config.advertise or f"http://{config.host}:{config.port}",
                      cpus=float(os.cpu_count() or 1), memory_mb=memory_mb,
                      max_sandboxes=config.admission.host_limit(runtime.slots.max_slots - 1),
                      runsc_release=runtime.release, cpu_features=cpu_features(),
                      templates=tuple(config.warm_templates))


def cpu_features() -> tuple[str, ...]:
    """The host CPU's feature flags (a checkpoint restores only where they are a superset of its host's)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return tuple(sorted(set(line.split(":", 1)[1].split())))
    except OSError:
        pass
    return ()
