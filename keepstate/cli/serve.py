"""`keepstate serve`: the API server and data-plane router on one listener."""

from __future__ import annotations

import asyncio
import logging
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from keepstate.config import DEFAULT_DISK_MB, MAX_SANDBOXES_PER_KEY, START_WAIT_SECONDS, home
from keepstate.errors import KeepStateError
from keepstate.ports import API_PORT, GATEWAY_PORT

from .common import EXIT_USAGE, Command, home_option
from .database import db_option
from .egress_options import egress_options
from .lifetime_options import lifetime_options
from .registry_options import registry_options

if TYPE_CHECKING:
    from keepstate.egress.service import EgressConfig


NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}")


@click.command(cls=Command)
@click.option("--listen", default=f"127.0.0.1:{API_PORT}", show_default=True, help="HOST:PORT to listen on.")
@click.option("--pool-size", default=2, show_default=True, type=int,
              help="Pre-started sandboxes kept ready per template (0 disables the warm pool).")
@click.option("--template-pool-size", default=1, show_default=True, type=int,
              help="Sandboxes restored ahead of demand for each built template (Template SDK, Dockerfile), "
                   "from its first create until 15 minutes pass without one (0: none).")
@click.option("--warm", default="base", show_default=True,
              help="Comma-separated templates to build (if needed) and keep warm at start.")
@click.option("--store", "store_url", default=None, envvar="KEEPSTATE_STORE",
              help="Checkpoint store URL: file:///path (default <home>/store) or "
                   "s3://bucket/prefix?endpoint=http://host:8333 (share it to resume on another server).")
@click.option("--gateway-config", type=click.Path(exists=True, dir_okay=False), default=None,
              envvar="KEEPSTATE_GATEWAY_CONFIG",
              help="Metering gateway configuration (providers, budgets; docs/design/gateway.md). With it, the "
                   "gateway serves sandboxes on 10.88.255.254:PORT and the host on 127.0.0.1:PORT, and every "
                   "sandbox gets OPENAI_*/ANTHROPIC_* variables pointing at it.")
@click.option("--gateway-port", default=GATEWAY_PORT, show_default=True, type=int, help="The gateway's port.")
@click.option("--standby-seconds", default=300, show_default=True, type=int,
              help="How long a paused sandbox is also kept frozen in memory, so that resuming it is a thaw "
                   "(milliseconds) instead of a restore from the store; 0 disables standbys.")
@click.option("--standby-mb", default=2048, show_default=True, type=int,
              help="Memory all standbys together may hold; the oldest are released first.")
@click.option("--freeze-idle-after", default=2.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds without a call into a sandbox after which, if nothing runs in it, it is frozen (its "
                   "cgroup: no CPU at all) until the next call thaws it, a few ms; 0 never freezes "
                   "(docs/design/idle.md).")
@click.option("--disk-mb", default=DEFAULT_DISK_MB, show_default=True, type=click.IntRange(min=0),
              help="Each sandbox's disk (its writable layer, a sparse image on this host) in MiB, when its template "
                   "names none: a fuller disk is ENOSPC for the writer (docs/design/sandbox-disk.md). 0 keeps the "
                   "layer in the sandbox's memory instead (no filesystem-only pause).")
@click.option("--volume-size-mb", default=1024, show_default=True, type=click.IntRange(16, 1 << 20),
              help="Quota of a new volume (E2B's Volume.create sends no size; POST /volumes may carry `sizeMB`). "
                   "A sandbox that fills its volume gets ENOSPC; the content API answers 413.")
@click.option("--volume-backend", default="ext4", show_default=True, type=click.Choice(["ext4", "dir"]),
              help="How volumes are kept: `ext4`, one sparse loop-mounted ext4 image per volume (needs root and "
                   "loop devices; the quota holds for sandboxes too), or `dir`, plain directories (the quota "
                   "holds for the content API only). docs/design/volumes.md")
@click.option("--boot-images/--no-boot-images", default=True, show_default=True,
              help="Start a template's sandboxes by restoring a checkpoint of its first fresh boot (taken before "
                   "it holds any token or session) instead of booting each: a fraction of a cold boot's CPU. "
                   "Templates with services, and sandboxes with volumes, always boot.")
@click.option("--max-starts", type=click.IntRange(min=1), default=None,
              help="Sandbox starts (cold starts, restores: create, pool refill, resume, fork, snapshot-create) run "
                   "at once; more wait in line. Default max(2, CPUs). docs/design/admission.md")
@click.option("--start-queue", type=click.IntRange(min=0), default=None,
              help="Starts that may wait for one of those, first come first served; one more is refused with 503 "
                   "and Retry-After. Default 8 x --max-starts.")
@click.option("--start-wait", type=click.FloatRange(min=0), default=START_WAIT_SECONDS, show_default=True,
              help="Seconds a start waits in line before it is refused (503, Retry-After).")
@click.option("--max-sandboxes", type=click.IntRange(min=0), default=None,
              help="Sandboxes this host holds at most (running, pre-started and paused in memory); a create beyond "
                   "is a 503. Default min(MemTotal / 64 MiB, 200 x CPUs, network slots); 0: no limit.")
@click.option("--max-sandboxes-per-key", type=click.IntRange(min=0), default=MAX_SANDBOXES_PER_KEY, show_default=True,
              help="Running sandboxes of one API key at once (paused ones do not count); beyond is a 429. 0: no "
                   "limit. A key's own limit (`keepstate keys limit NAME N`) wins.")
@click.option("--domain", default=None, envvar="KEEPSTATE_DOMAIN",
              help="The domain of port URLs: the SDK's get_host(port) is <port>-<sandboxID>.<domain>, and the router "
                   "serves that Host. Point a wildcard DNS name (*.DOMAIN) at this host. Default localhost:<port> "
                   "(the TLS port when TLS is on): every *.localhost name is loopback.")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Serve the router over TLS too with this certificate chain (PEM; e.g. a wildcard for *.DOMAIN).")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The private key of --tls-cert (PEM).")
@click.option("--tls-self-signed", is_flag=True,
              help="Serve the router over TLS with certificates this server's own CA issues per host name "
                   "(<home>/tls/router-ca.pem; `keepstate tls trust` shows how to trust it). For development.")
@click.option("--tls-listen", default=None,
              help="HOST:PORT of the TLS listener (same routes as --listen). Default <listen host>:3443 when TLS "
                   "is on.")
@click.option("--reap-on-exit", is_flag=True,
              help="Destroy this server's sandboxes when it stops (for tests; normally they outlive it).")
@click.option("--runtime", "runtime_kind", default="gvisor", show_default=True, type=click.Choice(["gvisor", "fake"]),
              help="Sandbox engine. `fake` runs keepstate.testing.FakeRuntime: in-process fake sandboxes with no "
                   "isolation and no command execution, for tests of the API and lifecycle only.")
@click.option("--secrets-key-file", type=click.Path(dir_okay=False), default=None,
              help="The key secrets are encrypted with at rest (AES-256-GCM): 32 bytes, raw or base64. Default "
                   "<home>/secrets.key, made (mode 0600) on first use; keep it apart from the catalog's backups. "
                   "KEEPSTATE_SECRETS_KEY (base64) overrides it.")
@click.option("--node", default=None, envvar="KEEPSTATE_NODE",
              help="Serve as the node NAME of a cluster sharing --db (PostgreSQL) and --store (S3): it renews a lease "
                   "in the database and fences itself when it cannot (docs/design/cluster.md). Default: one server, "
                   "node `local`, never fenced. Letters, digits and '-', at most 63. KEEPSTATE_NODE too.")
@click.option("--advertise", default=None, envvar="KEEPSTATE_ADVERTISE",
              help="The URL other nodes reach this one on (default http://<--listen>). KEEPSTATE_ADVERTISE too.")
@click.option("--on-stop", type=click.Choice(["keep", "pause", "handover"]), default=None,
              help="What a stop (SIGTERM) does with running sandboxes: `keep` them running for the next start to "
                   "adopt, `pause` each to the store (its standby released) so that another node can resume it at "
                   "its next call, or `handover`: pause each and hand it to another live node, which resumes it at "
                   "once (paused ones are handed over too). Default: pause for a node of a cluster (--node), else "
                   "keep.")
@click.option("--lease-ttl", type=click.FloatRange(min=1.0), default=None, envvar="KEEPSTATE_LEASE_TTL",
              help="A node's lease, seconds (default 10): renewed every fifth of it, fenced a fifth before it ends, "
                   "declared dead a whole lease after. Shorter moves a dead node's sessions sooner and puts more "
                   "load on the database. KEEPSTATE_LEASE_TTL too.")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=0, show_default=True,
              envvar="KEEPSTATE_CHECKPOINT_EVERY",
              help="Checkpoint every running sandbox this often (seconds, incrementally; 0: never), so that one "
                   "whose node is lost resumes elsewhere from its latest checkpoint (docs/design/cluster.md). A "
                   "create's `checkpointEvery` overrides it. KEEPSTATE_CHECKPOINT_EVERY too.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@lifetime_options
@egress_options
@registry_options
@home_option
@db_option
def serve(listen: str, pool_size: int, template_pool_size: int, warm: str, store_url: str | None,
          gateway_config: str | None,
          gateway_port: int, standby_seconds: int, standby_mb: int, freeze_idle_after: float,
          disk_mb: int, volume_size_mb: int,
          volume_backend: str, max_starts: int | None, start_queue: int | None, start_wait: float,
          max_sandboxes: int | None, max_sandboxes_per_key: int, boot_images: bool, domain: str | None,
          tls_cert: str | None, tls_key: str | None, tls_self_signed: bool, tls_listen: str | None,
          reap_on_exit: bool, runtime_kind: str, secrets_key_file: str | None, node: str | None,
          advertise: str | None, on_stop: str | None, lease_ttl: float | None, checkpoint_every: int, log_level: str,
          egress: EgressConfig, max_timeout: int, paused_retention: float | None) -> None:
    """Run the E2B-compatible API and the data-plane router.

    \b
    Point the stock E2B SDK at it:
      export E2B_API_URL=http://127.0.0.1:3000 E2B_SANDBOX_URL=http://127.0.0.1:3000
      export E2B_API_KEY=$(keepstate keys dev)

    Sandboxes outlive the server: stop it (or kill -9 it) and start it again, and it
    re-adopts every sandbox that is still running.
    """
    from keepstate.api import listeners
    from keepstate.api.app import ServerConfig, create_app
    from keepstate.cluster.membership import FENCE_MARGIN_S, RENEW_S, TTL_S
    from keepstate.sandbox.admission import AdmissionConfig
    from keepstate.secret.crypto import KEY_FILE, load_key
    from keepstate.template import builder

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # First: KEEPSTATE_SECRETS_KEY leaves the environment before any child process (a template build) could
    # inherit it.
    secrets_key = load_key(Path(secrets_key_file) if secrets_key_file else home() / KEY_FILE)
    host, _, port = listen.rpartition(":")
    if node is not None and not NODE_NAME.fullmatch(node):
        raise click.UsageError(f"--node {node!r}: a node's name is letters, digits and '-', at most 63, starting "
                               "with a letter or digit")
    if advertise is not None and not re.fullmatch(r"https?://[^/\s]+/?", advertise):
        raise click.UsageError(f"--advertise {advertise!r}: give the URL other nodes reach this one on, such as "
                               "http://10.0.0.5:3000")
    try:  # before any build: a wrong TLS option fails at once
        sites, domain = listeners.plan(home(), host or "127.0.0.1", int(port), domain, tls_cert, tls_key,
                                       tls_self_signed, tls_listen)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    db_url = check_database(secrets_key, node)  # before any build: a bad --db fails at once, nothing listening
    warm_names = tuple(w for w in warm.split(",") if w)
    if runtime_kind != "fake":  # the fake runtime's templates need no build
        for name in warm_names:
            builder.ensure_built(name)
    config = ServerConfig(home=home(), host=host or "127.0.0.1", port=int(port), pool_size=pool_size,
                          template_pool_size=template_pool_size,
                          warm_templates=warm_names, reap_on_exit=reap_on_exit,
                          store_url=store_url, gateway_config=Path(gateway_config) if gateway_config else None,
                          gateway_port=gateway_port, standby_seconds=standby_seconds, standby_mb=standby_mb,
                          freeze_idle_after=freeze_idle_after,
                          disk_mb=disk_mb, runtime=runtime_kind, volume_size_mb=volume_size_mb,
                          volume_backend=volume_backend, boot_images=boot_images, domain=domain,
                          secrets_key=secrets_key, db_url=db_url, node=node, on_stop=on_stop,
                          checkpoint_every=checkpoint_every,
                          lease=(lease_ttl, lease_ttl / 5, lease_ttl / 5) if lease_ttl else (TTL_S, RENEW_S,
                                                                                             FENCE_MARGIN_S),
                          advertise=advertise.rstrip("/") if advertise else None,
                          admission=AdmissionConfig(max_starts=max_starts, start_queue=start_queue,
                                                    start_wait=start_wait, max_sandboxes=max_sandboxes,
                                                    max_sandboxes_per_key=max_sandboxes_per_key),
                          egress=egress, max_timeout=max_timeout, paused_retention=paused_retention)
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    click.echo(f"keepstate: serving on {', '.join(s.url for s in sites)}, port URLs <port>-<id>.{domain} "
               f"(data in {config.home})", err=True)
    # auto_decompress=False: the router forwards request bodies as they came (gzip uploads stay gzip).
    listeners.run(create_app(config), sites, access_log=None, shutdown_timeout=5, auto_decompress=False)


def check_database(secrets_key: bytes, node: str | None = None) -> str:
    """Open the database once before serving: upgraded, an older release's files imported, the secrets key the one
    its secrets were sealed with. Any failure ends the command here with one line and exit code 2. Its URL."""
    from keepstate.db.setup import LOCAL_NODE, db_url, prepare
    from keepstate.secret import SecretStore
    from keepstate.secret.crypto import Sealer

    url = db_url(home())

    async def check() -> None:
        db = await prepare(url, home(), node or LOCAL_NODE)
        try:
            await SecretStore(db, Sealer(secrets_key)).check_key()
        finally:
            await db.close()

    try:
        asyncio.run(check())
    except KeepStateError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    return url
