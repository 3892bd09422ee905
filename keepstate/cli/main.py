"""The `keepstate` command line.

Subcommands live in their own modules and are imported only when used, so that
`keepstate --help` and quick read commands start fast.
"""

from __future__ import annotations

import importlib
import sys

import click

from keepstate.cli.common import EXIT_CODES_HELP, Group

# name -> ("module:attribute" of a click command or group, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("keepstate.cli.serve:serve", "Run the API server and data-plane router."),
    "sandbox": ("keepstate.cli.sandbox:sandbox", "List, create, exec in and kill sandboxes."),
    "template": ("keepstate.cli.template:template", "List and build sandbox templates."),
    "keys": ("keepstate.cli.keys:keys", "Create, list and revoke API keys."),
    "store": ("keepstate.cli.store:store", "Verify and garbage-collect the checkpoint store."),
    "checkpoint": ("keepstate.cli.checkpoint:checkpoint", "List, verify, export and import checkpoints."),
    "events": ("keepstate.cli.events:events", "Read and verify a session's causal history."),
    "gateway": ("keepstate.cli.gateway:gateway", "Run the model-call metering gateway alone."),
    "ledger": ("keepstate.cli.ledger:ledger", "Show and reconcile the model-call ledger."),
    "tls": ("keepstate.cli.tls:tls", "The router's TLS CA: where it is and how to trust it."),
    "db": ("keepstate.cli.db:db", "The database: its revision, upgrade, and import of an older release's files."),
    "nodes": ("keepstate.cli.nodes:nodes", "List, drain and remove the nodes of a cluster."),
    "deploy": ("keepstate.cli.deploy:deploy", "Print a systemd unit or Kubernetes manifest for a cluster node."),
}


class LazyGroup(Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = SUBCOMMANDS.get(cmd_name)
        if entry is None:
            return None
        module_name, attr = entry[0].split(":")
        found: click.Command = getattr(importlib.import_module(module_name), attr)
        return found

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, help_) for name, (_, help_) in sorted(SUBCOMMANDS.items())]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, epilog=EXIT_CODES_HELP)
@click.version_option(package_name="keepstate")
def cli() -> None:
    """KeepState: E2B-compatible sandboxes on gVisor, with durable sessions.

    \b
    Quick start:
      make up                       # set up the host and serve on 127.0.0.1:3000
      export E2B_API_URL=http://127.0.0.1:3000 E2B_SANDBOX_URL=http://127.0.0.1:3000
      export E2B_API_KEY=<the key `make up` printed>
      python -c "from e2b import Sandbox; print(Sandbox.create().commands.run('uname -a').stdout)"

    Data lives in $KEEPSTATE_HOME (default /var/lib/keepstate).
    """


def main() -> None:
    try:
        cli(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
