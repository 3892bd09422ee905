"""`serve`'s egress options (docs/design/network.md), gathered into one EgressConfig passed as `egress`."""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from keepstate.egress.service import EgressConfig


def _cidr(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    for v in value:
        try:
            net = ipaddress.ip_network(v, strict=False)
        except ValueError:
            raise click.BadParameter(f"{v!r} is not a CIDR block (e.g. 192.168.10.0/24)") from None
        if net.version != 4:
            raise click.BadParameter(f"{v!r}: IPv6 is not routed for sandboxes")
    return value


def _upstream(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    from keepstate.egress.resolver import parse_upstream

    for v in value:
        try:
            host, port = parse_upstream(v)
            ipaddress.ip_address(host)
            if not 1 <= port <= 65535:
                raise ValueError
        except ValueError:
            raise click.BadParameter(f"{v!r} is not IP or IP:PORT") from None
    return value


def egress_options(f: Callable[..., Any]) -> Callable[..., Any]:
    @click.option("--egress", "egress_mode", type=click.Choice(["on", "off"]), default="on", show_default=True,
                  envvar="KEEPSTATE_EGRESS",
                  help="Sandboxes' way out (each as its network policy says). off: nothing leaves any sandbox. "
                       "Env: KEEPSTATE_EGRESS (tests outside an isolated namespace set it to off).")
    @click.option("--dns-upstream", multiple=True, callback=_upstream, metavar="IP[:PORT]",
                  help="DNS server the sandboxes' resolver asks (repeatable). Default: the host's /etc/resolv.conf.")
    @click.option("--egress-ca-bundle", type=click.Path(exists=True, dir_okay=False), default=None,
                  help="PEM file of more CAs the sandboxes and the egress proxy trust (beside the system's).")
    @click.option("--egress-allow-private", multiple=True, callback=_cidr, metavar="CIDR",
                  help="A private range sandboxes may reach when their policy allows it (repeatable), e.g. a model "
                       "server on the LAN. Other sandboxes stay unreachable whatever it says.")
    @click.option("--egress-max-connections", type=click.IntRange(min=0), default=1024, show_default=True,
                  help="Concurrent connections one sandbox may have open out; 0: no limit.")
    @click.option("--egress-rate-mbit", type=click.FloatRange(min=0), default=0, show_default=True,
                  help="Bandwidth of one sandbox each way, in Mbit/s; 0: unlimited.")
    @functools.wraps(f)
    def wrapper(*args: Any, egress_mode: str, dns_upstream: tuple[str, ...], egress_ca_bundle: str | None,
                egress_allow_private: tuple[str, ...], egress_max_connections: int, egress_rate_mbit: float,
                **kwargs: Any) -> Any:
        kwargs["egress"] = EgressConfig(
            enabled=egress_mode == "on", dns_upstreams=dns_upstream,
            ca_bundle=Path(egress_ca_bundle) if egress_ca_bundle else None, allow_private=egress_allow_private,
            max_connections=egress_max_connections, rate_mbit=egress_rate_mbit)
        return f(*args, **kwargs)

    return wrapper
