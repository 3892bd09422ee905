"""E2B secrets end to end: the stock SDK's `Secret` API against a real server of this module's own (restarted in
the middle), and raw HTTP for the error shapes and for what every response carries: never the value. The value is
not in the server's log (run at debug level) nor, in plain text, in any file of its data directory.

Imports no keepstate code.
"""

from __future__ import annotations

import os
import secrets as pysecrets
import tempfile
import urllib.parse
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from sdkharness import Server, make_key, start_server

try:
    from e2b import Secret, SecretInfo
    from e2b.exceptions import SecretException, SecretNotFoundException
except ImportError:  # SDK releases before secrets
    Secret = None

pytestmark = pytest.mark.skipif(Secret is None, reason="this e2b SDK release has no Secret API")
EXTRA = ("--warm", "", "--log-level", "debug", "--reap-on-exit")
ENV = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")
# Distinct values, each findable as bytes: one per create/update of the module.
VALUES: list[str] = []


def value() -> str:
    made = "ks-secret-" + pysecrets.token_hex(16)
    VALUES.append(made)
    return made


@pytest.fixture(scope="module")
def own(e2b_env: None) -> Iterator[dict[str, Any]]:
    """A server of this module's own (no sandboxes: the secrets API needs none), the SDK pointed at it."""
    home = tempfile.mkdtemp(prefix="keepstate-secrets-")
    saved_validate = os.environ.get("KEEPSTATE_VALIDATE_RESPONSES")
    os.environ["KEEPSTATE_VALIDATE_RESPONSES"] = "1"  # every answer checked against openapi.yaml
    srv = start_server(home, pool=0, extra=EXTRA)
    srv.key = make_key(home)
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update({"E2B_API_URL": srv.url, "E2B_SANDBOX_URL": srv.url, "E2B_API_KEY": srv.key})
    state: dict[str, Any] = {"server": srv, "home": home}
    try:
        yield state
    finally:
        for k, v in [*saved.items(), ("KEEPSTATE_VALIDATE_RESPONSES", saved_validate)]:
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc = state["server"].proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)


def api(srv: Server) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"X-API-KEY": srv.key}, timeout=60)


def json_error(r: httpx.Response, status: int, words: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert body["code"] == status and isinstance(body["message"], str), body
    assert words.lower() in body["message"].lower(), body


def no_value_in(r: httpx.Response) -> None:
    seen = r.content + "".join(f"{k}: {v}\n" for k, v in r.headers.items()).encode()
    for v in VALUES:
        assert v.encode() not in seen, (r.request.method, r.request.url, r.status_code)


def test_create_get_update_list_delete_with_the_sdk(own: dict[str, Any]) -> None:
    first = value()
    info = Secret.create("SDK-Key", first, metadata={"owner": "team-a"})
    assert isinstance(info, SecretInfo) and info.secret_id.startswith("sec_")
    assert (info.name, info.version, info.metadata) == ("sdk-key", 1, {"owner": "team-a"})
    assert isinstance(info.created_at, datetime) and info.created_at == info.updated_at
    assert Secret.get_info(info.secret_id) == info == Secret.get_info("SDK-KEY")
    assert Secret.exists("sdk-key") and not Secret.exists("no-such-secret")

    updated = Secret.update("sdk-key", value())
    assert (updated.secret_id, updated.version, updated.metadata) == (info.secret_id, 2, {"owner": "team-a"})
    assert updated.updated_at >= info.updated_at and updated.created_at == info.created_at
    replaced = Secret.update(info.secret_id, value(), metadata={"rotated": "yes"})
    assert (replaced.version, replaced.metadata) == (3, {"rotated": "yes"})
    assert Secret.get_info("sdk-key").version == 3

    more = [Secret.create(f"page-{i}", value()).secret_id for i in range(5)]
    paginator = Secret.list(limit=2)
    pages: list[list[str]] = []
    while paginator.has_next:
        pages.append([s.secret_id for s in paginator.next_items()])
    listed = [sid for page in pages for sid in page]
    assert listed == [info.secret_id, *more] and [len(p) for p in pages] == [2, 2, 2]
    assert [s.secret_id for s in Secret.list().next_items()] == listed  # one page of them all

    assert Secret.destroy("page-0") is True and Secret.destroy("page-0") is False
    assert Secret.destroy(more[1]) is True
    with pytest.raises(SecretNotFoundException):
        Secret.get_info("page-0")
    assert not Secret.exists(more[1])
    assert [s.secret_id for s in Secret.list().next_items()] == [info.secret_id, *more[2:]]


def test_errors_through_the_sdk(own: dict[str, Any]) -> None:
    Secret.create("dup-name", value())
    with pytest.raises(SecretException, match="409.*exists"):
        Secret.create("DUP-NAME", value())
    with pytest.raises(SecretException, match="400.*name"):
        Secret.create("has space", value())
    with pytest.raises(SecretException, match="400.*value"):
        Secret.create("empty-value", "")
    with pytest.raises(SecretException, match="400.*metadata"):
        Secret.create("big-meta", value(), metadata={f"k{i}": "v" for i in range(33)})
    with pytest.raises(SecretNotFoundException):
        Secret.update("no-such-secret", value())
    with pytest.raises(SecretNotFoundException):
        Secret.get_info("sec_0000")
    assert not Secret.exists("empty-value") and not Secret.exists("big-meta")
    assert Secret.get_info("dup-name").version == 1  # the refused create changed nothing


def test_errors_are_json_and_no_response_carries_a_value(own: dict[str, Any]) -> None:
    srv: Server = own["server"]
    secret = value()
    with api(srv) as c:
        seen = []
        seen.append(r := c.post("/secrets", json={"name": "raw", "value": secret, "metadata": {"m": "1"}}))
        assert r.status_code == 201 and set(r.json()) == {"secretID", "name", "currentVersion", "metadata",
                                                           "createdAt", "updatedAt"}
        sid = r.json()["secretID"]
        seen.append(r := c.post("/secrets", json={"name": "RAW", "value": secret}))
        json_error(r, 409, "exists")
        seen.append(r := c.post(f"/secrets/{sid}", json={"value": value()}))
        assert r.status_code == 200 and r.json()["currentVersion"] == 2
        seen.append(r := c.get("/secrets/raw"))
        assert r.status_code == 200 and r.json()["secretID"] == sid
        # A second secret of this test's own: a page of one then has a next page whichever tests ran before this
        # one on this server (under xdist, this module's tests are shared out between workers, each with a server).
        seen.append(r := c.post("/secrets", json={"name": "raw-two", "value": value()}))
        assert r.status_code == 201
        seen.append(r := c.get("/secrets", params={"limit": 1}))
        assert r.status_code == 200 and r.headers["x-next-token"] != ""
        seen.append(r := c.get("/secrets", params={"nextToken": r.headers["x-next-token"], "limit": 100}))
        assert r.status_code == 200 and r.headers["x-next-token"] == ""  # the last page
        for bad, words in ((b"", "json object"), (b"[]", "json object"), (b"{", "malformed"),
                           (b'{"name": "x"}', "value"), (b'{"value": "v"}', "name"),
                           (b'{"name": "sec_x", "value": "v"}', "reserved"),
                           (b'{"name": "x", "value": "a\\r\\nb"}', "cr, lf"),
                           (b'{"name": "x", "value": "v", "metadata": {"k": 1}}', "metadata")):
            seen.append(r := c.post("/secrets", content=bad, headers={"content-type": "application/json"}))
            json_error(r, 400, words)
        seen.append(r := c.post(f"/secrets/{sid}", json={"value": 5}))
        json_error(r, 400, "value")
        seen.append(r := c.post("/secrets/missing", json={"value": secret}))
        json_error(r, 404, "not found")
        seen.append(r := c.get("/secrets", params={"nextToken": "zz"}))
        json_error(r, 400, "nexttoken")
        seen.append(r := c.get("/secrets", params={"limit": 0}))
        json_error(r, 400, "limit")
        seen.append(r := c.post("/secrets", json={"name": "big", "value": "v" * (64 * 1024 + 1)}))
        json_error(r, 400, "value")
        seen.append(r := httpx.get(srv.url + "/secrets", timeout=60))
        json_error(r, 401, "api key")
        seen.append(r := c.get("/health"))
        assert r.status_code == 200
        seen.append(r := c.delete("/secrets/raw"))
        assert r.status_code == 204
        seen.append(r := c.delete("/secrets/raw"))
        json_error(r, 404, "not found")
        seen.append(r := c.delete("/secrets/raw-two"))
        assert r.status_code == 204
        for r in seen:
            no_value_in(r)


def restart(state: dict[str, Any]) -> Server:
    old: Server = state["server"]
    assert old.proc is not None
    old.proc.terminate()
    old.proc.wait(timeout=120)
    port = urllib.parse.urlparse(old.url).port
    srv = start_server(state["home"], port=port, pool=0, extra=EXTRA)
    srv.key = old.key
    state["server"] = srv
    return srv


def test_a_restart_keeps_the_secrets(own: dict[str, Any]) -> None:
    made = Secret.create("survivor", value(), metadata={"k": "v"})
    Secret.update("survivor", value())
    before = [s.secret_id for s in Secret.list().next_items()]
    restart(own)
    again = Secret.get_info("survivor")
    assert (again.secret_id, again.version, again.metadata, again.created_at) == (
        made.secret_id, 2, {"k": "v"}, made.created_at)
    assert [s.secret_id for s in Secret.list().next_items()] == before
    assert Secret.update("survivor", value()).version == 3  # versions go on where they were


def test_no_value_in_the_log_or_in_plain_text_on_disk(own: dict[str, Any]) -> None:
    """Last in the module: every value it made, against every file of the data directory (the log included)."""
    home = Path(own["home"])
    assert VALUES and (home / "server.log").stat().st_size > 0 and (home / "keepstate.sqlite").exists()
    checked = 0
    for path in home.rglob("*"):
        if not path.is_file() or path.is_symlink() or path.stat().st_size > 256 << 20:
            continue
        data = path.read_bytes()
        checked += 1
        for v in VALUES:
            assert v.encode() not in data, f"a secret's value is in {path} in plain text"
    assert checked >= 3
