"""The state table is written down once, in code; the design doc's copy of it must say the same."""

from __future__ import annotations

from pathlib import Path

import pytest

from keepstate.errors import Conflict, NotFound
from keepstate.sandbox.state import (
    ADOPTION,
    AFTER_CRASH,
    LEGAL,
    PUBLIC,
    TRANSITIONS,
    Command,
    State,
    require,
    transition,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "design" / "sandbox-lifecycle.md"


def doc_table() -> dict[tuple[str, str], tuple[str, str, str]]:
    text = DOC.read_text()
    table = text.split("<!-- transition-table:", 1)[1].split("\n\n", 1)[0]
    out = {}
    for line in table.splitlines()[3:]:
        command, state, transient, success, failure = [c.strip() for c in line.strip("|").split("|")]
        out[command, state] = (transient, success, failure)
    return out


def test_the_design_doc_table_is_the_code_table() -> None:
    assert doc_table() == {(str(c), str(s)): (str(t.transient or "–"), str(t.success), str(t.failure))
                           for (c, s), t in TRANSITIONS.items()}


def test_commands_start_from_stable_states_and_every_command_has_a_row() -> None:
    assert {c for c, _ in TRANSITIONS} == set(Command)
    for (command, state), move in TRANSITIONS.items():
        assert state in (State.POOLED, State.RUNNING, State.PAUSED), (command, state)
        assert move.failure == state  # a command that fails leaves the sandbox where it found it
        assert move.transient is None or move.transient not in (State.RUNNING, State.PAUSED, State.POOLED)
        assert move.transient is None or AFTER_CRASH[move.transient] in (state, State.KILLED, move.success)
        assert transition(command, state, "sbx") is move


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
