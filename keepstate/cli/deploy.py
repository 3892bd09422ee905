"""`keepstate deploy`: the files that run a node of a cluster on a real host (docs/deploy.md).

They are rendered from the templates in deploy_templates/ (package data): `{{ name }}` is a value of the command
line, already quoted for the file it goes into (single quotes in an EnvironmentFile, JSON in YAML). Nothing else of
a template is touched, so systemd's `${VAR}` and Kubernetes' `$(VAR)` reach the file as written. deploy/ holds each
one rendered with the example values of docs/deploy.md (tests/deploy checks they are what these commands print).
"""

from __future__ import annotations

import json
import os
import re
import sys
from importlib import resources
from pathlib import Path

import click

from keepstate.ports import API_PORT

from .common import Group
from .serve import NODE_NAME

PLACEHOLDER = re.compile(r"\{\{ (\w+) \}\}")
ADVERTISE = re.compile(r"https?://[^/\s]+/?")  # what `keepstate serve --advertise` accepts
K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a DNS label: names of Kubernetes objects
ENV_FILE = "/etc/keepstate/node.env"
DEFAULT_EXECUTABLE = "/opt/keepstate/bin/keepstate"


def render(template: str, values: dict[str, str]) -> str:
    """The template deploy_templates/`template` with every `{{ name }}` replaced by values[name]."""
    text = resources.files("keepstate.cli").joinpath("deploy_templates", template).read_text()
    missing = sorted(set(PLACEHOLDER.findall(text)) - set(values))
    if missing:
        raise AssertionError(f"{template}: no value for {', '.join(missing)}")
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def env_value(name: str, value: str) -> str:
    """`value` single-quoted, as systemd's EnvironmentFile and a shell both read it literally."""
    if "'" in value or "\n" in value:
        raise click.BadParameter(f"{value!r}: no single quote or newline in a value of the EnvironmentFile",
                                 param_hint=name)
    return f"'{value}'"


def split_serve_args(value: str) -> list[str]:
    """Extra `keepstate serve` options: split at spaces, which is all systemd does with $KEEPSTATE_SERVE_ARGS."""
    if any(c in value for c in "'\"\\"):
        raise click.BadParameter("options split at spaces: no quotes or backslashes", param_hint="--serve-args")
    return value.split()


def check_cluster(db: str | None, store: str) -> None:
    if db is not None and not db.lower().startswith(("postgresql://", "postgres://")):
        raise click.BadParameter("the nodes of a cluster share one PostgreSQL database: postgresql://…",
                                 param_hint="--db")
    if not store.startswith("s3://"):
        raise click.BadParameter("the nodes of a cluster share one S3-compatible store: s3://bucket/prefix…",
                                 param_hint="--store")


def default_executable() -> str:
    """The keepstate beside this Python (an installed venv's), else where docs/deploy.md installs it."""
    beside = Path(sys.executable).with_name("keepstate")
    return str(beside) if beside.is_file() else DEFAULT_EXECUTABLE


@click.group(cls=Group)
def deploy() -> None:
    """Print the files that run a node of a cluster: a systemd unit, or a Kubernetes DaemonSet and Service.

    \b
    Examples (docs/deploy.md):
      keepstate deploy systemd unit > /etc/systemd/system/keepstate-node.service
      (umask 077; keepstate deploy systemd env --node host-a --advertise http://10.0.0.5:3000 \\
         --db postgresql://keepstate@db.internal/keepstate \\
         --store 's3://sessions/ks?endpoint=http://s3.internal:8333' > /etc/keepstate/node.env)
      keepstate deploy kubernetes --image registry.example.com/keepstate:0.1.0 \\
         --store 's3://sessions/ks?endpoint=http://s3.internal:8333' | kubectl apply -f -
    """


@deploy.group(cls=Group)
def systemd() -> None:
    """A systemd unit (the same on every host) and each host's EnvironmentFile."""


@systemd.command("unit")
@click.option("--keepstate", "executable", default=default_executable, show_default="this keepstate",
              help="Absolute path of the keepstate command on the host.")
@click.option("--env-file", default=ENV_FILE, show_default=True, help="Where the host's EnvironmentFile is.")
def unit(executable: str, env_file: str) -> None:
    """The unit keepstate-node.service: `keepstate serve` as the node its EnvironmentFile names."""
    for name, path in (("--keepstate", executable), ("--env-file", env_file)):
        if not path.startswith("/") or any(c.isspace() for c in path):
            raise click.BadParameter(f"{path!r}: an absolute path without spaces", param_hint=name)
    header = "Made by `keepstate deploy systemd unit`. Install: docs/deploy.md"
    click.echo(render("keepstate-node.service", {"header": header, "keepstate": executable, "env_file": env_file}),
               nl=False)


@systemd.command("env")
@click.option("--node", required=True, help="This host's node name: letters, digits and '-', at most 63.")
@click.option("--advertise", required=True, help="The URL other nodes reach this one on, e.g. http://10.0.0.5:3000.")
@click.option("--listen", default=f"0.0.0.0:{API_PORT}", show_default=True, help="HOST:PORT to listen on.")
@click.option("--db", envvar="KEEPSTATE_DB", required=True,
              help="The cluster's PostgreSQL database (postgresql://…); KEEPSTATE_DB too, to keep a password off "
                   "the command line.")
@click.option("--store", envvar="KEEPSTATE_STORE", required=True,
              help="The cluster's S3-compatible store (s3://bucket/prefix?endpoint=…); KEEPSTATE_STORE too.")
@click.option("--secrets-key-file", default="/etc/keepstate/secrets.key", show_default=True,
              help="The secrets key, a copy of the same file on every node.")
@click.option("--home", "home_dir", default="/var/lib/keepstate", show_default=True, help="This host's data directory.")
@click.option("--serve-args", default="", help="More `keepstate serve` options, e.g. '--domain sbx.example.com'.")
def env(node: str, advertise: str, listen: str, db: str, store: str, secrets_key_file: str, home_dir: str,
        serve_args: str) -> None:
    """The host's EnvironmentFile (/etc/keepstate/node.env, mode 0600): its node name, address, database, store.

    AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, when set in this command's environment, are copied into it (the
    store's credentials, kept off the command line); else they are left as commented lines to fill in.
    """
    if not NODE_NAME.fullmatch(node):
        raise click.BadParameter("letters, digits and '-', at most 63, starting with a letter or digit",
                                 param_hint="--node")
    if not ADVERTISE.fullmatch(advertise):
        raise click.BadParameter("the URL other nodes reach this one on, such as http://10.0.0.5:3000",
                                 param_hint="--advertise")
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise click.BadParameter("HOST:PORT, e.g. 0.0.0.0:3000", param_hint="--listen")
    check_cluster(db, store)
    s3: list[str] = []
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        given = os.environ.get(name)
        s3.append(f"{name}={env_value(name, given)}" if given else f"#{name}=''")
    values = {"node": node, "advertise": advertise, "listen": listen, "db": db, "store": store,
              "secrets_key_file": secrets_key_file, "home": home_dir,
              "serve_args": " ".join(split_serve_args(serve_args))}
    quoted = {k: env_value(f"--{k.replace('_', '-')}", v) for k, v in values.items()}
    header = "Made by `keepstate deploy systemd env`."
    click.echo(render("node.env", {**quoted, "header": header, "env_file": ENV_FILE, "s3_credentials": "\n".join(s3)}),
               nl=False)


@deploy.command("kubernetes")
@click.option("--image", required=True, help="The keepstate image (built from deploy/Dockerfile), e.g. "
                                             "registry.example.com/keepstate:0.1.0.")
@click.option("--store", envvar="KEEPSTATE_STORE", required=True,
              help="The cluster's S3-compatible store (s3://bucket/prefix?endpoint=…); its keys go in the Secret.")
@click.option("--name", default="keepstate", show_default=True, help="Name of the DaemonSet and the Service.")
@click.option("--secret", default="keepstate", show_default=True,
              help="The Secret holding db-url, secrets-key and (optional) s3-access-key, s3-secret-key.")
@click.option("--port", default=API_PORT, show_default=True, type=click.IntRange(1, 65535),
              help="The nodes' port and the Service's.")
@click.option("--service-type", default="ClusterIP", show_default=True,
              type=click.Choice(["ClusterIP", "NodePort", "LoadBalancer"]))
@click.option("--runsc", default="/usr/bin/runsc", show_default=True, help="Where runsc is on every host.")
@click.option("--data-dir", default="/var/lib/keepstate", show_default=True, help="The data directory on each host.")
@click.option("--node-name-from", "node_field", default="spec.nodeName", show_default=True,
              type=click.Choice(["spec.nodeName", "metadata.name"]),
              help="The node's name: its Kubernetes node's (stable; it must be letters, digits and '-') or its "
                   "pod's (for node names with dots; a replaced pod joins as a new node).")
@click.option("--node-selector", multiple=True, metavar="KEY=VALUE",
              help="Run only on Kubernetes nodes with this label (repeatable), e.g. those with runsc installed.")
@click.option("--serve-args", default="", help="More `keepstate serve` options, e.g. '--domain sbx.example.com'.")
def kubernetes(image: str, store: str, name: str, secret: str, port: int, service_type: str, runsc: str,
               data_dir: str, node_field: str, node_selector: tuple[str, ...], serve_args: str) -> None:
    """A DaemonSet (a privileged node on each Kubernetes node, runsc from the host) and a Service in front of all.

    The database URL and the secrets key are read from a Secret: see docs/deploy.md for `kubectl create secret`.
    """
    check_cluster(None, store)
    for hint, value in (("--name", name), ("--secret", secret)):
        if not K8S_NAME.fullmatch(value):
            raise click.BadParameter("lowercase letters, digits and '-', at most 63", param_hint=hint)
    for hint, path in (("--runsc", runsc), ("--data-dir", data_dir)):
        if not path.startswith("/"):
            raise click.BadParameter(f"{path!r}: an absolute path", param_hint=hint)
    if not image or any(c.isspace() for c in image):
        raise click.BadParameter(f"{image!r} is not an image reference", param_hint="--image")
    selector: dict[str, str] = {}
    for pair in node_selector:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--node-selector")
        selector[key] = value
    args = ["serve", "--node", "$(KEEPSTATE_NODE)", "--advertise", "$(KEEPSTATE_ADVERTISE)",
            "--listen", f"0.0.0.0:{port}", "--on-stop", "pause", *split_serve_args(serve_args)]
    values = {"header": "Made by `keepstate deploy kubernetes`. Install: docs/deploy.md", "name": name,
              "secret": secret, "port": str(port), "service_type": service_type, "node_field": node_field,
              "image": json.dumps(image), "store": json.dumps(store), "runsc": json.dumps(runsc),
              "data_dir": json.dumps(data_dir), "node_selector": json.dumps(selector),
              "args": "\n".join(f"            - {json.dumps(a)}" for a in args)}
    click.echo(render("keepstate.yaml", values), nl=False)
