"""The egress proxy from inside real sandboxes (stock SDK, the fake internet): a SOCKS5 upstream with and without
credentials, failing closed when the upstream cannot be used, its password never shown; and a secret set on
requests by a header rule while the sandbox can find its value nowhere (environment, files, /proc, the proxy's
own answers), until the test's own echo site sends it back.

Only inside an isolated namespace linked to the fake internet (scripts/test.sh), like test_network.py.
"""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from sdkharness import SCAN, fake_internet, isolated

pytestmark = pytest.mark.skipif(not isolated() or fake_internet() is None,
                                reason="needs an isolated network namespace linked to the fake internet "
                                       "(scripts/test.sh, or scripts/isolated.sh + keepstate.testing.internet up)")

PLAIN = "198.51.100.10"  # plain.test


def fetch(sbx: Any, url: str) -> tuple[int, str]:
    """(curl's exit code, body) of a GET from inside the sandbox; a refusal must be quick (never curl's -m)."""
    r = sbx.commands.run(f"curl -s -m 20 {url}; echo \" $?\"", timeout=60)
    body, _, status = r.stdout.rpartition(" ")
    assert int(status) != 28, f"{url} timed out: a refused connection must fail at once"
    return int(status), body


def socks_log() -> list[dict[str, Any]]:
    state = fake_internet()
    assert state is not None
    with urllib.request.urlopen(state["socks_log_url"], timeout=10) as r:
        return list(json.loads(r.read()))


def api(server: Any, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    req = urllib.request.Request(server.url + path, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"X-API-KEY": server.key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read()
            return r.status, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def connects_through_socks(before: int, port: int) -> list[dict[str, Any]]:
    return [e for e in socks_log()[before:] if str(e).find(PLAIN) >= 0 and str(e).find(str(port)) >= 0]


def test_traffic_goes_through_the_socks5_upstream(new_sandbox, server) -> None:
    state = fake_internet()
    assert state is not None
    socks = state["socks"]
    before = len(socks_log())
    sbx = new_sandbox(network={"egress_proxy": {"address": f"{socks['host']}:{socks['port']}"}})
    status, body = fetch(sbx, "http://plain.test/")
    assert status == 0 and "site plain.test" in body, body
    assert connects_through_socks(before, socks["port"]), socks_log()[before:]


def test_socks5_credentials_are_used_and_never_shown(new_sandbox, server) -> None:
    state = fake_internet()
    assert state is not None
    auth = state["socks_auth"]
    address = f"{auth['host']}:{auth['port']}"
    before = len(socks_log())
    sbx = new_sandbox(network={"egress_proxy": {"address": address, "username": auth["user"],
                                                "password": auth["password"]}})
    status, body = fetch(sbx, "http://plain.test/")
    assert status == 0 and "site plain.test" in body, body
    assert connects_through_socks(before, auth["port"])
    code, info = api(server, "GET", f"/sandboxes/{sbx.sandbox_id}")
    assert code == 200
    assert info["network"]["egressProxy"] == {"address": address, "username": auth["user"]}
    assert "password" not in json.dumps(info)


def test_a_socks5_upstream_that_fails_is_never_bypassed(new_sandbox) -> None:
    state = fake_internet()
    assert state is not None
    auth = state["socks_auth"]
    wrong = new_sandbox(network={"egress_proxy": {"address": f"{auth['host']}:{auth['port']}",
                                                  "username": auth["user"], "password": "wrong"}})
    assert fetch(wrong, "http://plain.test/")[0] != 0
    gone = new_sandbox(network={"egress_proxy": {"address": "198.51.100.99:1080"}})  # nothing listens there
    assert fetch(gone, "http://plain.test/")[0] != 0
    assert fetch(gone, f"http://{PLAIN}/")[0] != 0
    gone.update_network({})  # no upstream any more: direct
    status, body = fetch(gone, f"http://{PLAIN}/")
    assert status == 0 and "site plain.test" in body


@pytest.fixture
def secret(server: Any) -> Iterator[tuple[str, str]]:
    name, value = f"s{secrets.token_hex(4)}", f"val-{secrets.token_hex(12)}"
    assert api(server, "POST", "/secrets", {"name": name, "value": value})[0] == 201
    yield name, value
    api(server, "DELETE", f"/secrets/{name}")


def test_the_sandbox_finds_a_secret_nowhere(new_sandbox, server, secret) -> None:
    name, value = secret
    gone_name = f"g{secrets.token_hex(4)}"
    assert api(server, "POST", "/secrets", {"name": gone_name, "value": f"gone-{secrets.token_hex(8)}"})[0] == 201
    headers = {"Authorization": "Bearer ${e2b.secrets.%s}" % name}
    sbx = new_sandbox(network={
        "allow_out": ["plain.test", "echo.test"], "deny_out": ["0.0.0.0/0"],
        "rules": {"plain.test": [{"transform": {"headers": headers}}],
                  "echo.test": [{"transform": {"headers": {"X-Gone": "${e2b.secrets.%s}" % gone_name}}}]}})
    # Requests the rule rewrites, whose answers do not echo: over HTTP, over HTTPS (intercepted), and to a port
    # where nothing listens (the proxy's own failure answer).
    outputs = []
    for url in ("http://plain.test/", "https://plain.test/", "http://plain.test:81/", "https://plain.test:444/"):
        r = sbx.commands.run(f"curl -s -i -m 20 {url} 2>&1; true", timeout=60)
        outputs.append(r.stdout + r.stderr)
    assert "site plain.test" in outputs[0] and "site plain.test" in outputs[1], outputs[:2]
    # A secret deleted after the rule was set: the proxy refuses the request, naming the secret, not any value.
    api(server, "DELETE", f"/secrets/{gone_name}")
    r = sbx.commands.run("curl -s -i -m 20 http://echo.test/echo; true", timeout=60)
    assert " 502 " in r.stdout.splitlines()[0] and gone_name in r.stdout, r.stdout
    outputs.append(r.stdout)
    for out in outputs:
        assert value not in out
    sbx.files.write("/tmp/scan.py", SCAN)
    scan = json.loads(sbx.commands.run(f"python3 /tmp/scan.py {value.encode().hex()}", timeout=600)
                      .stdout.strip().splitlines()[-1])
    assert scan["found"] == [] and scan["files"] > 1000, scan
    # And the rule does set it (the echo site sends the request's headers back).
    sbx.update_network({"allow_out": ["echo.test"], "deny_out": ["0.0.0.0/0"],
                        "rules": {"echo.test": [{"transform": {"headers": headers}}]}})
    for url in ("http://echo.test/echo", "https://echo.test/echo"):
        echoed = json.loads(sbx.commands.run(f"curl -s -m 20 {url}", timeout=60).stdout)
        assert echoed["headers"].get("authorization") == f"Bearer {value}", echoed
