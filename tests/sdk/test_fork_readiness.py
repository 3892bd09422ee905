"""Fork readiness (docs/design/sandbox-lifecycle.md, "Fork readiness"): every child of a fork is handed out with
the ports that listened in its parent listening again, even with the host's cores kept busy. A user's own
server started in the parent answers through its port URL in each child at the first request, not a 502."""

from __future__ import annotations

import time
from typing import Any

import httpx

from sdkharness import BusyCores, Server

ROUNDS, CHILDREN = 6, 3
# http.server as it comes (HTTP/1.0: it closes each connection after its answer, so the parent's netstack holds
# TIME_WAIT endpoints on the port when it is checkpointed) and as HTTP/1.1 (the router's keep-alive connection is
# open until the fork's quiesce closes it).
PORTS = {8000: "HTTP/1.0", 8001: "HTTP/1.1"}


def get(server: Server, sbx: Any, port: int, path: str = "/marker.txt") -> httpx.Response:
    """A GET of the sandbox's port URL (`<port>-<id>.<domain>`, the router matches the Host)."""
    with httpx.Client(trust_env=False, timeout=60) as client:
        return client.get(server.url + path, headers={"Host": sbx.get_host(port)})


def test_forks_of_a_users_server_answer_at_once_under_load(new_sandbox: Any, server: Server) -> None:
    sbx = new_sandbox(timeout=600)
    sbx.files.write("/tmp/www/marker.txt", "served by the parent\n")
    for port, protocol in PORTS.items():
        sbx.commands.run(f"python3 -m http.server {port} --protocol {protocol} --directory /tmp/www",
                         background=True)
    deadline = time.monotonic() + 60
    while any(get(server, sbx, port).status_code != 200 for port in PORTS):
        assert time.monotonic() < deadline, "the parent's http.servers did not start"
        time.sleep(0.2)
    failures = []
    with BusyCores(2):
        for r in range(ROUNDS):
            for port in PORTS:  # requests just before the fork, as a user's would be
                assert get(server, sbx, port).status_code == 200
            forks = sbx.fork(count=CHILDREN, timeout=120)
            try:
                for i, child in enumerate(forks):
                    for port in PORTS:
                        answer = get(server, child, port)  # the first request, no waiting: no 502
                        if answer.status_code != 200 or answer.text != "served by the parent\n":
                            failures.append(f"round {r} child {i} ({child.sandbox_id}) port {port}: "
                                            f"{answer.status_code} {answer.text}")
            finally:
                for child in forks:
                    child.kill()
    assert not failures, failures
