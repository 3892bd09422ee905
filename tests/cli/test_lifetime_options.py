"""`keepstate serve --max-timeout / --paused-retention`: durations as operators write them (`7d`, `12h`, seconds),
their environment variables, and a usage error (exit 2) for anything else."""

from __future__ import annotations

from typing import Any

import click
import pytest
from click.testing import CliRunner

from keepstate.cli.lifetime_options import lifetime_options, parse_duration


@click.command()
@lifetime_options
def shown(**options: Any) -> None:
    click.echo(repr((options["max_timeout"], options["paused_retention"])))


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("7d", 604800), ("12h", 43200), ("1d12h", 129600),
                                               ("1.5h", 5400), ("30m", 1800), ("2w", 1209600), (" 45S ", 45)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5", "7 d", "1y", "d", "inf", "nan", "12h-1m"])
def test_not_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_the_options_and_their_environment() -> None:
    runner = CliRunner()
    assert runner.invoke(shown, []).output == "(86400, None)\n"  # E2B's 24 h; paused sandboxes kept
    assert runner.invoke(shown, ["--max-timeout", "0", "--paused-retention", "7d"]).output == "(0, 604800.0)\n"
    assert runner.invoke(shown, ["--paused-retention", "keep"]).output == "(86400, None)\n"
    env = {"KEEPSTATE_MAX_TIMEOUT": "604800", "KEEPSTATE_PAUSED_RETENTION": "12h"}
    assert runner.invoke(shown, [], env=env).output == "(604800, 43200.0)\n"
    for bad in (["--paused-retention", "soon"], ["--paused-retention", "0"], ["--max-timeout", "-1"]):
        result = runner.invoke(shown, bad)
        assert result.exit_code == 2, (bad, result.output)
