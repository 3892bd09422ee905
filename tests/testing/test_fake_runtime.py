"""The fake runtime's instances start without asking any resolver: http.server's own bind looks its address up
(socket.getfqdn), a reverse DNS query of 127.N.x.y that inside the tests' isolated namespace nobody answers, and
each instance start then took 5-10 s (a create bounded at 20 s failed a fresh-clone run)."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from keepstate.ports import AGENT_PORT
from keepstate.testing import FakeRuntime
from keepstate.testing.fake_runtime import AgentState, FakeAgent

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # straight to the address, never a proxy


def test_an_instance_starts_and_answers_without_a_name_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_lookup(*args: object) -> None:
        raise AssertionError(f"a name lookup {args}: a query to the host's resolver")

    monkeypatch.setattr(socket, "getfqdn", no_lookup)
    monkeypatch.setattr(socket, "gethostbyaddr", no_lookup)
    runtime = FakeRuntime()
    try:
        address = runtime.address_of(7)
        agent = FakeAgent(address, AgentState())
        try:
            with OPENER.open(f"http://{address}:{AGENT_PORT}/health", timeout=10) as r:
                assert r.status == 204
        finally:
            agent.stop()
    finally:
        runtime.close()
