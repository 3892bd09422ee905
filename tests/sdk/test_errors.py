"""Bad input gets a clear JSON error of one shape, {"code": int, "message": str}, everywhere."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from sdkharness import AGENT_PORT


def call(url: str, method: str = "GET", body: bytes | None = None, headers: dict[str, str] | None = None,
         ) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=30) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw)


def assert_error(status: int, body: Any, expected: int) -> None:
    assert status == expected, body
    assert isinstance(body, dict) and body["code"] == expected and isinstance(body["message"], str)
    assert body["message"]


def test_missing_and_bad_api_key(server) -> None:
    assert_error(*call(server.url + "/v2/sandboxes"), 401)
    assert_error(*call(server.url + "/v2/sandboxes", headers={"X-API-KEY": "wrong"}), 401)


def test_malformed_json(server) -> None:
    h = {"X-API-KEY": server.key, "Content-Type": "application/json"}
    status, body = call(server.url + "/v2/sandboxes", "POST", b'{"templateID": "base",', h)
    assert_error(status, body, 400)
    assert "malformed JSON" in body["message"]
    status, body = call(server.url + "/v2/sandboxes", "POST", b'[1,2]', h)
    assert_error(status, body, 400)
    status, body = call(server.url + "/v2/sandboxes", "POST", b'{"templateID": "base", "timeout": "x"}', h)
    assert_error(status, body, 400)
    assert "timeout" in body["message"]
    status, body = call(server.url + "/v2/sandboxes", "POST", b'{"templateID": "base", "timeout": 999999}', h)
    assert_error(status, body, 400)
    status, body = call(server.url + "/v2/sandboxes", "POST", b'{"templateID": "base", "envVars": {"a": 1}}', h)
    assert_error(status, body, 400)


def test_unknown_things(server) -> None:
    h = {"X-API-KEY": server.key}
    assert_error(*call(server.url + "/sandboxes/" + "z" * 20, headers=h), 404)
    assert_error(*call(server.url + "/sandboxes/" + "z" * 20, "DELETE", headers=h), 404)
    assert_error(*call(server.url + "/no/such/route", headers=h), 404)
    status, body = call(server.url + "/v2/sandboxes", "POST", json.dumps({"templateID": "nope"}).encode(),
                        {**h, "Content-Type": "application/json"})
    assert_error(status, body, 404)


def test_data_plane_unknown_sandbox(server) -> None:
    status, body = call(server.url + "/health",
                        headers={"E2b-Sandbox-Id": "q" * 20, "E2b-Sandbox-Port": str(AGENT_PORT)})
    assert status == 502
    assert body == {"sandboxId": "q" * 20, "message": "The sandbox was not found", "code": 502}


def test_data_plane_closed_port(sandbox, server) -> None:
    status, body = call(server.url + "/", headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8123"})
    assert status == 502 and body["port"] == 8123
    assert "port is not open" in body["message"]


def test_agent_refuses_bad_token(sandbox, server) -> None:
    h = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": str(AGENT_PORT), "X-Access-Token": "wrong",
         "Content-Type": "application/json"}
    status, body = call(server.url + "/filesystem.Filesystem/Stat", "POST", b'{"path": "/"}', h)
    assert_error(status, body, 401)
    status, body = call(server.url + "/files?path=/etc/hostname", headers=h)
    assert_error(status, body, 401)


def test_host_only_agent_paths_are_not_routed(sandbox, server) -> None:
    h = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": str(AGENT_PORT), "Content-Type": "application/json"}
    status, body = call(server.url + "/init", "POST", b'{"accessToken": "mine"}', h)
    assert_error(status, body, 403)


@pytest.mark.parametrize("path", ["/files?path=../../../../etc/shadow&username=user",
                                  "/files?path=/etc/shadow&username=user"])
def test_path_traversal_reads_nothing_secret(sandbox, server, path: str) -> None:
    token = sandbox._envd_access_token if hasattr(sandbox, "_envd_access_token") else None
    h = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": str(AGENT_PORT)}
    if token:
        h["X-Access-Token"] = token
    status, body = call(server.url + path, headers=h)
    # /etc/shadow is root-only: as `user` it is refused, never served, and the error is JSON
    assert status in (401, 403, 404), body
    assert isinstance(body, dict) and body["code"] == status


def test_oversized_upload_is_refused(sandbox, server) -> None:
    h = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": str(AGENT_PORT),
         "Content-Type": "application/octet-stream", "Content-Length": str(64 << 30)}
    req = urllib.request.Request(server.url + "/files?path=big.bin", data=b"", method="POST", headers=h)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with pytest.raises(urllib.error.HTTPError) as err:
        opener.open(req, timeout=30)
    assert err.value.code == 413
    body = json.loads(err.value.read())
    assert body["code"] == 413 and "upload" in body["message"]
