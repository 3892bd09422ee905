"""The state table is written down once, in code; the design doc's copy of it must say the same."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from keepstate.errors import Conflict, NotFound
from keepstate.sandbox.state import ADOPTION, AFTER_CRASH, LEGAL, PUBLIC, Command, State, require

DOC = Path(__file__).resolve().parents[2] / "docs" / "design" / "sandbox-lifecycle.md"


def doc_table() -> dict[str, set[str]]:
    text = DOC.read_text()
    table = text.split("<!-- legal-table:", 1)[1].split("\n\n", 1)[0]
    out = {}
    for line in table.splitlines()[3:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[0]] = {w for w in re.split(r",\s*", cells[1]) if w in {s.value for s in State}}
    return out


def test_the_design_doc_table_is_the_code_table() -> None:
    assert doc_table() == {str(c): {str(s) for s in LEGAL[c]} for c in Command}


def test_every_state_has_an_adoption_rule_and_transient_states_map_to_stable_ones() -> None:
    assert set(ADOPTION) == set(State)
    for transient, stable in AFTER_CRASH.items():
        assert transient not in LEGAL[Command.CONNECT] and stable in (State.RUNNING, State.PAUSED, State.KILLED)
    assert set(PUBLIC.values()) == {"running", "paused"}


@pytest.mark.parametrize("command", list(Command))
@pytest.mark.parametrize("state", list(State))
def test_require_refuses_exactly_what_the_table_refuses(command: Command, state: State) -> None:
    if state in LEGAL[command]:
        require(command, state, "sbx")
        return
    gone = state in (State.KILLED, State.KILLING) or (state == State.POOLED and command != Command.CREATE)
    with pytest.raises(NotFound if gone else Conflict) as exc:
        require(command, state, "sbx")
    assert "sbx" in exc.value.message
