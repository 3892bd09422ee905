"""`keepstate serve` options for sandboxes' lifetimes (docs/design/cluster.md, "Lifetimes and retention"):
`--max-timeout` and `--paused-retention`."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import click

from keepstate.sandbox.creates import MAX_TIMEOUT

F = TypeVar("F", bound=Callable[..., Any])

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
KEEP = ("keep", "forever", "none")  # --paused-retention's default, said explicitly


def parse_duration(text: str) -> float:
    """Seconds of a duration: a number of seconds (`3600`), or numbers with units s, m, h, d, w (`7d`, `12h`,
    `1d12h`, `1.5h`). ValueError if it is not one, or not more than zero."""
    raw = text.strip().lower()
    try:
        seconds = float(raw)
    except ValueError:
        if not raw or _PART.sub("", raw) != "":
            raise ValueError(f"{text!r} is not a duration: give seconds, or e.g. 7d, 12h, 1d12h, 30m") from None
        seconds = sum(float(n) * UNITS[unit] for n, unit in _PART.findall(raw))
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{text!r}: a duration must be more than zero")
    return seconds


class Duration(click.ParamType[float | None, Any]):
    name = "DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float | None:
        if value is None or isinstance(value, float):
            return value
        if str(value).strip().lower() in KEEP:
            return None
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def lifetime_options(f: F) -> F:
    f = click.option("--paused-retention", type=Duration(), default=None, envvar="KEEPSTATE_PAUSED_RETENTION",
                     help="How long a sandbox may stay paused (seconds, or e.g. 7d, 12h): one paused longer is "
                          "deleted, as a kill would (its history says reason `retention`), its pause checkpoints "
                          "are unpublished and the store's garbage is collected, one node at a time in a cluster "
                          "(a lease in the database), so that paused memory holding secrets does not live forever. "
                          "Default: keep paused sandboxes forever (and collect nothing by itself: `keepstate store "
                          "gc`). KEEPSTATE_PAUSED_RETENTION too.")(f)
    f = click.option("--max-timeout", type=click.IntRange(min=0), default=MAX_TIMEOUT, show_default=True,
                     envvar="KEEPSTATE_MAX_TIMEOUT",
                     help="The longest timeout, in seconds, a create, connect, resume, fork or set-timeout may ask "
                          "(beyond: a 400, \"Timeout cannot be greater than 24 hours\" at the default, E2B's Pro "
                          "plan); 0: no limit (a week-long session: 604800). Paused time is not counted: a resume "
                          "starts the clock again. KEEPSTATE_MAX_TIMEOUT too.")(f)
    return f
