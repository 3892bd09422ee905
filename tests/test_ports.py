"""One number per port (keepstate/ports.py): the places that must spell one out agree with it."""

from __future__ import annotations

from keepstate import ports
from keepstate.template import definition
from tests.agent import harness
from tests.sdk import sdkharness


def test_suites_without_keepstate_imports_agree() -> None:
    assert harness.AGENT_PORT == sdkharness.AGENT_PORT == ports.AGENT_PORT


def test_the_interpreter_template_serves_the_bridge_port() -> None:
    service = next(s for s in definition.load("code-interpreter-v1").services if s.name == "code-interpreter")
    assert service.port == ports.INTERPRETER_PORT
    assert service.command[service.command.index("--port") + 1] == str(ports.INTERPRETER_PORT)


def test_agent_defaults() -> None:
    from keepstate.agent import DEFAULT_PORT
    from keepstate.agent.interpreter import DEFAULT_PORT as BRIDGE_PORT

    assert (DEFAULT_PORT, BRIDGE_PORT) == (ports.AGENT_PORT, ports.INTERPRETER_PORT)
