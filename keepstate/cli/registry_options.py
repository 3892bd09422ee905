"""`keepstate serve` options for pulling OCI images (docs/design/oci-images.md, "References").

They set the environment the puller reads (keepstate/template/oci/ref.py), so a build worker started by the
server sees the same settings without threading them through every call.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import click

from keepstate.template.oci.ref import INSECURE_ENV, MIRROR_ENV, valid_host

F = TypeVar("F", bound=Callable[..., object])


def _mirror(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value:
        if not valid_host(value):
            raise click.BadParameter(f"`{value}` is not HOST[:PORT]")
        os.environ[MIRROR_ENV] = value


def _insecure(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> None:
    for v in value:
        if not valid_host(v):
            raise click.BadParameter(f"`{v}` is not HOST[:PORT]")
    if value:
        os.environ[INSECURE_ENV] = ",".join(value)


def registry_options(f: F) -> F:
    f = click.option("--insecure-registry", multiple=True, metavar="HOST[:PORT]", expose_value=False,
                     callback=_insecure,
                     help="A registry reached over plain HTTP (loopback ones always are); repeatable. "
                          f"${INSECURE_ENV} (comma-separated) sets it too.")(f)
    f = click.option("--registry-mirror", metavar="HOST[:PORT]", envvar=MIRROR_ENV, expose_value=False,
                     callback=_mirror,
                     help="Where an image named without a registry (`python:3.12`) or on docker.io is pulled "
                          "from. Without it such a reference is refused: name the registry in the image.")(f)
    return f
