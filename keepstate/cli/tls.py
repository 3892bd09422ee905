"""`keepstate tls`: the router's own CA (`serve --tls-self-signed`), and how a developer's machine trusts it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import click

from keepstate.config import home

from .common import Group, home_option

SYSTEM_DIR = Path("/usr/local/share/ca-certificates")
INSTALLED_NAME = "keepstate-router-ca.crt"


@click.group(cls=Group)
def tls() -> None:
    """The router's TLS certificates.

    \b
    Examples:
      keepstate serve --tls-self-signed      # HTTPS port URLs on 127.0.0.1:3443, leaves from the router's CA
      keepstate tls trust                    # where that CA is, and the command that trusts it
      sudo keepstate tls trust --install     # trust it system-wide (Debian/Ubuntu)
    """


@tls.command("trust")
@click.option("--install", is_flag=True,
              help=f"Copy the CA to {SYSTEM_DIR}/{INSTALLED_NAME} and run update-ca-certificates (needs root).")
@home_option
def trust(install: bool) -> None:
    """Print the path of the router's CA (made now if the server has not made it yet) and how to trust it."""
    from keepstate.api.listeners import ROUTER_CA, router_ca

    router_ca(home())
    path = home() / "tls" / f"{ROUTER_CA}-ca.pem"
    click.echo(str(path))
    target = SYSTEM_DIR / INSTALLED_NAME
    if not install:
        click.echo(f"# trust it system-wide (curl, Python's ssl, most tools):\n"
                   f"sudo cp {path} {target} && sudo update-ca-certificates\n"
                   f"# or per program: SSL_CERT_FILE / REQUESTS_CA_BUNDLE / NODE_EXTRA_CA_CERTS={path}\n"
                   f"# (SSL_CERT_FILE replaces the system bundle: use a file holding both if you need both)",
                   err=True)
        return
    if shutil.which("update-ca-certificates") is None:
        raise click.ClickException("update-ca-certificates is not installed (apt-get install ca-certificates)")
    try:
        SYSTEM_DIR.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    except PermissionError:
        raise click.ClickException(f"cannot write {target}: run it as root (sudo keepstate tls trust --install)") \
            from None
    done = subprocess.run(["update-ca-certificates"], capture_output=True, text=True)
    if done.returncode != 0:
        raise click.ClickException(f"update-ca-certificates failed: {(done.stderr or done.stdout).strip()}")
    click.echo(f"installed as {target}", err=True)
