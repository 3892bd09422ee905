"""Malformed requests are 400s, never 500s: the body parser, the field parsers, and the real handlers behind a stub
manager (no sandboxes), each response also checked against docs/openapi.yaml."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
import yarl
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from keepstate.api import app as app_module
from keepstate.api import control, events, schemas, spec
from keepstate.api.idempotent import IdempotentCreates
from keepstate.api.keys import ENVD_VERSION, IDEMPOTENT, MANAGER
from keepstate.db import migrate
from keepstate.db.engine import Database
from keepstate.db.repos import History
from keepstate.db.url import default_url
from keepstate.errors import BadRequest, NotFound
from keepstate.session import EventLog, Lineage

BAD_BODIES = [
    b"\xff\xfe{}",  # not UTF-8 (what schemathesis found: UnicodeDecodeError -> 500)
    b'{"templateID": "\xc3"}',  # truncated UTF-8 sequence inside a string
    b"\xed\xa0\x80",  # an encoded surrogate: not UTF-8 either
    b"{",
    b"{}}",
    b'{"timeout": NaN}',
    b'{"timeout": Infinity}',
    b'{"timeout": -Infinity}',
    b'{"timeout": 1e999}',
    b'{"timeout": -1e999}',
    b'{"timeout": ' + b"9" * 5000 + b"}",  # past Python's int-string limit (ValueError, not JSONDecodeError)
    b"[" * 100_000 + b"]" * 100_000,  # RecursionError inside json
    b'{"a": ' + b"[" * 70 + b"]" * 70 + b"}",  # deeper than MAX_JSON_DEPTH
    b'{"templateID": "\\ud800"}',  # a lone surrogate: valid JSON, no valid text
    b'{"metadata": {"\\udfff": "x"}}',
]


@pytest.mark.parametrize("raw", BAD_BODIES, ids=lambda b: repr(b[:24]))
def test_parse_json_refuses_with_400(raw: bytes) -> None:
    with pytest.raises(BadRequest) as info:
        schemas.parse_json(raw)
    assert info.value.status == 400 and info.value.message


def test_parse_json_accepts_json() -> None:
    assert schemas.parse_json(b' {"a": [1, 2.5, "\\u00e9", null, true]} ') == {"a": [1, 2.5, "é", None, True]}
    assert schemas.parse_json("\ufeff{}".encode()) == {}  # a UTF-8 byte-order mark is ignored
    assert schemas.parse_json(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}  # a surrogate *pair* is fine
    assert schemas.parse_json(b'{"n": ' + b"9" * 400 + b"}")["n"] == int("9" * 400)
    assert schemas.parse_json(b"", required=False) is None
    with pytest.raises(BadRequest):
        schemas.parse_json(b"")
    with pytest.raises(BadRequest):  # blanks alone are not JSON, even where a body is optional
        schemas.parse_json(b"  \n", required=False)
    with pytest.raises(BadRequest):
        schemas.parse_object(b" ")
    assert schemas.parse_object(b"") == {}
    nested: Any = {}
    for _ in range(schemas.MAX_JSON_DEPTH - 1):
        nested = {"x": nested}
    assert schemas.parse_json(json.dumps(nested).encode()) == nested


@pytest.mark.parametrize("raw", [b"[]", b"0", b"false", b'""', b"null", b"[1]", b'"x"'])
def test_parse_object_refuses_other_json_values(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        schemas.parse_object(raw)


def test_parse_object_empty_is_empty() -> None:
    assert schemas.parse_object(b"") == {} and schemas.parse_object(b'{"memory": true}') == {"memory": True}


WRONG_TYPES: list[Any] = [None, True, False, 0, -1, 1.5, "x", "", [], [1], {}, {"a": 1}, 10**30]


def _values_but(*ok: Any) -> list[Any]:
    return [v for v in WRONG_TYPES if not any(v is o or (type(v) is type(o) and v == o) for o in ok)]


@pytest.mark.parametrize("field,ok", [
    ("templateID", ("x",)),
    ("timeout", (1.5,)),
    ("autoPause", (False, True)),
    ("allow_internet_access", (None, True, False)),
    ("metadata", (None, {})),
    ("envVars", (None, {})),
    ("cpuCount", (None, 1.5)),
    ("memoryMB", (None,)),
    ("gateway", (True, False)),
])
def test_create_refuses_every_wrong_type(field: str, ok: tuple[Any, ...]) -> None:
    for value in _values_but(*ok):
        body = {"templateID": "base", field: value}
        with pytest.raises(BadRequest):
            schemas.parse_create(body)
    for value in ok:
        schemas.parse_create({"templateID": "base", field: value})


@pytest.mark.parametrize("body", [
    {"templateID": "base", "timeout": 0.5},  # truncates to 0
    {"templateID": "base", "timeout": -(10**40)},
    {"templateID": "base", "timeout": 86400.5},
    {"templateID": "base", "timeout": float("nan")},
    {"templateID": "base", "timeout": float("-inf")},
    {"templateID": "base", "cpuCount": 1e-300},  # a zero CPU quota
    {"templateID": "base", "cpuCount": 65},
    {"templateID": "base", "cpuCount": float("nan")},
    {"templateID": "base", "memoryMB": 512.5},
    {"templateID": "base", "memoryMB": 63},
    {"templateID": "base", "envVars": {"": "x"}},
    {"templateID": "base", "envVars": {"A=B": "x"}},
    {"templateID": "base", "envVars": {"A\0": "x"}},
    {"templateID": "base", "envVars": {"A": "x\0y"}},
    {"templateID": "base", "metadata": {"a": {"nested": "x"}}},
    {"templateID": "   "},
])
def test_create_refuses_out_of_range(body: dict[str, Any]) -> None:
    with pytest.raises(BadRequest):
        schemas.parse_create(body)


def test_create_accepts_what_the_contract_allows() -> None:
    req = schemas.parse_create({"templateID": "base", "timeout": 86400.0, "cpuCount": 0.5, "memoryMB": 512.0,
                                "envVars": {"A": "1=2"}, "metadata": {"k": "\u0000"}, "unknown": [1, {}]})
    assert req.timeout == 86400 and req.cpu == 0.5 and req.memory_mb == 512 and isinstance(req.memory_mb, int)
    assert schemas.parse_create({"templateID": "base", "timeout": 1.9}).timeout == 1


def test_create_parses_volume_mounts() -> None:
    assert schemas.parse_create({"templateID": "base", "volumeMounts": []}).volume_mounts == []
    assert schemas.parse_create({"templateID": "base", "volumeMounts": None}).volume_mounts == []
    req = schemas.parse_create({"templateID": "base", "volumeMounts": [{"name": "v", "path": "/mnt//data/"},
                                                                       {"name": "v", "path": "/home/user/v"}]})
    assert req.volume_mounts == [("v", "/mnt/data"), ("v", "/home/user/v")]
    bad: list[tuple[Any, str]] = [
        ("v:/data", "list"), ([{"name": "v"}], "object"), ([{"name": "", "path": "/d"}], "name a volume"),
        ([{"name": "v", "path": "data"}], "absolute"), ([{"name": "v", "path": "/"}], "may not be `/`"),
        ([{"name": "v", "path": "/a/../etc"}], r"`\.\.`"), ([{"name": "v", "path": "/proc/x"}], "/proc"),
        ([{"name": "v", "path": "/opt"}], "/opt/keepstate"), ([{"name": "v", "path": "/dev"}], "/dev"),
        ([{"name": "v", "path": "/sys/fs"}], "/sys"),
        ([{"name": "a", "path": "/mnt"}, {"name": "b", "path": "/mnt/b"}], "nest"),
        ([{"name": "a", "path": "/mnt"}, {"name": "b", "path": "/mnt"}], "nest"),
    ]
    for mounts, message in bad:
        with pytest.raises(BadRequest, match=message):
            schemas.parse_create({"templateID": "base", "volumeMounts": mounts})


def test_refresh_and_resume_bodies() -> None:
    assert schemas.parse_refresh_body({}) == 15 and schemas.parse_refresh_body({"duration": 3600.0}) == 3600
    assert schemas.parse_resume_body({}) == (15, None, True)
    assert schemas.parse_resume_body({"timeout": 60, "autoPause": False, "memory": False}) == (60, False, False)
    for bad in ({"duration": 3601}, {"duration": -1}, {"duration": 1.5}, {"duration": None}, {"duration": "1"}):
        with pytest.raises(BadRequest):
            schemas.parse_refresh_body(bad)
    for bad_resume in ({"timeout": 0}, {"autoPause": 1}, {"memory": "yes"}):
        with pytest.raises(BadRequest):
            schemas.parse_resume_body(bad_resume)


def test_timeout_bodies() -> None:
    assert schemas.parse_timeout_body(None, required=False) == 300
    assert schemas.parse_timeout_body({}, required=False) == 300
    assert schemas.parse_timeout_body({"timeout": 0}, required=True) == 0  # set_timeout(0) expires now
    assert schemas.parse_timeout_body({"timeout": -5}, required=True) == -5
    for body in ({"timeout": 0}, {"timeout": -1}, {"timeout": 0.4}):
        with pytest.raises(BadRequest):
            schemas.parse_timeout_body(body, required=False)  # connect and fork need a positive one
    bad_bodies: list[Any] = [{"timeout": "10"}, {"timeout": None}, {"timeout": True}, {"timeout": [1]},
                             {"timeout": 86401}, {"timeout": float("nan")}, {"timeout": float("inf")},
                             {"timeout": float("-inf")}, [], "x", 5]
    for bad in bad_bodies:
        for required in (True, False):
            with pytest.raises(BadRequest):
                schemas.parse_timeout_body(bad, required=required)
    with pytest.raises(BadRequest):
        schemas.parse_timeout_body({}, required=True)


def test_pause_snapshot_and_fork_bodies() -> None:
    assert schemas.parse_pause_body({}) == (True, False)
    assert schemas.parse_pause_body({"memory": False}) == (False, False)
    assert schemas.parse_pause_body({"requireHealthyGuest": True}) == (True, True)
    assert schemas.parse_snapshot_body({}) == (None, True)
    assert schemas.parse_snapshot_body({"name": "n", "memory": False}) == ("n", False)
    assert schemas.parse_fork_body({}) == (1, 300)
    assert schemas.parse_fork_body({"count": 3.0, "timeout": 60}) == (3, 60)
    pauses: list[dict[str, Any]] = [{"memory": "no"}, {"memory": 0}, {"memory": None}, {"requireHealthyGuest": 1}]
    for bad in pauses:
        with pytest.raises(BadRequest):
            schemas.parse_pause_body(bad)
    snapshots: list[dict[str, Any]] = [{"name": ""}, {"name": "  "}, {"name": 5}, {"name": "x" * 129},
                                       {"memory": "x"}]
    for bad in snapshots:
        with pytest.raises(BadRequest):
            schemas.parse_snapshot_body(bad)
    forks: list[dict[str, Any]] = [{"count": 0}, {"count": 21}, {"count": True}, {"count": "2"}, {"count": 1.5},
                                   {"count": 10**30}, {"count": float("nan")}, {"timeout": 0}, {"timeout": "x"}]
    for bad in forks:
        with pytest.raises(BadRequest):
            schemas.parse_fork_body(bad)


@pytest.mark.parametrize("token", ["x", "%%%", "\u00e9", "====", "AAAA",
                                   "MDAwMS0wMS0wMVQwMDowMDowMF9fYQ"])  # year 1, no offset: "year 0 is out of range"
def test_bad_cursors_are_400(token: str) -> None:
    with pytest.raises(BadRequest):
        schemas.decode_cursor(token)


@pytest.mark.parametrize("value", ["", "yesterday", "0001-01-01T00:00:00", "2026-13-01T00:00:00Z", "\x00",
                                   "2026-01-01T00:00:00+25:00"])
def test_bad_times_are_400(value: str) -> None:
    with pytest.raises(BadRequest):
        schemas.parse_time(value, "startedAfter")


@pytest.mark.parametrize("query", [
    {"limit": "9" * 5000}, {"limit": "-1"}, {"limit": "1.5"}, {"limit": "101"}, {"order": "sideways"},
    {"state": "running,dead"}, {"metadata": "novalue"}, {"metadata": "%ZZ"}, {"startedAfter": "soon"},
    {"nextToken": "@@"},
])
def test_bad_list_queries_are_400(query: dict[str, str]) -> None:
    with pytest.raises(BadRequest):
        schemas.filter_and_page([], query)


# -- the real handlers, behind a stub manager -------------------------------------------------------------------
class StubManager:
    """Every call that gets past parsing lands here: it records the parsed arguments and answers 404."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.pools: dict[str, Any] = {}
        self.live: dict[str, Any] = {}
        self.rows = self
        self.table = self  # the sandbox table's query methods too

    async def snapshots(self) -> list[dict[str, Any]]:
        return []

    def listed(self) -> list[Any]:
        return []

    async def cluster_listed(self) -> list[Any]:
        return []

    def find(self, sandbox_id: str) -> None:
        return None

    def running(self) -> list[Any]:
        return []

    def admission(self) -> dict[str, Any]:
        from tests.api.test_spec import HEALTH

        return dict(HEALTH["admission"])

    def teardowns_pending(self) -> int:
        return 0

    async def find_snapshot(self, ref: str) -> None:
        self.calls.append(("find_snapshot", (ref,)))
        return None

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            # Raised at the call, so that it is a 404 whether the handler awaits the method or not.
            self.calls.append((name, args))
            raise NotFound(f"sandbox \"{args[0] if args else ''}\" not found")

        return call


errors_as_json = app_module.errors_as_json  # what the server itself does with errors (a 500 here fails the test)


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[
        tuple[TestClient[web.Request, web.Application], StubManager]]:
    stub = StubManager()
    db = await Database.open(default_url(tmp_path_factory.mktemp("sessions")))
    await migrate.upgrade(db)
    log, lineage = EventLog(History(db)), Lineage(History(db))
    await log.append("s1", "sandbox.created", {"template": "base"})
    await lineage.record_session("s1", "base")
    app = web.Application(middlewares=[spec.validating_middleware(enabled=True), errors_as_json],
                          client_max_size=1 << 20)
    app[MANAGER] = cast(Any, stub)
    app[IDEMPOTENT] = IdempotentCreates(db, cast(Any, stub), lambda: "node/local/1", control.recorded_answer(app))
    app[ENVD_VERSION] = "0.6.13"
    app[events.EVENTS] = log
    app[events.LINEAGE] = lineage
    app.add_routes(control.routes)
    app.add_routes(events.routes)
    async with TestClient(TestServer(app)) as c:
        yield c, stub
    await db.close()


@pytest.fixture
def client(server: tuple[TestClient[web.Request, web.Application], StubManager]) -> Any:
    server[1].calls.clear()
    return server


def _assert_error(status: int, body: Any, expected: int) -> None:
    assert status == expected, body
    assert isinstance(body, dict) and body["code"] == expected and isinstance(body["message"], str), body


BODY_ROUTES = ["/v2/sandboxes", "/sandboxes", "/v2/sandboxes/abc/connect", "/sandboxes/abc/connect",
               "/sandboxes/abc/timeout", "/sandboxes/abc/pause", "/sandboxes/abc/snapshots", "/sandboxes/abc/fork"]


@pytest.mark.parametrize("path", BODY_ROUTES)
@pytest.mark.parametrize("raw", BAD_BODIES[:12] + [b'{"a": "\\ud800"}', b"[]", b"0", b"false", b"null"],
                         ids=lambda b: repr(b[:16]))
async def test_malformed_bodies_are_400_on_every_route(client: Any, path: str, raw: bytes) -> None:
    c, stub = client
    resp = await c.post(path, data=raw, headers={"Content-Type": "application/json"})
    _assert_error(resp.status, await resp.json(), 400)
    assert not [call for call in stub.calls if call[0] != "find_snapshot"]


async def test_too_large_body_is_413(client: Any) -> None:
    c, _ = client
    resp = await c.post("/v2/sandboxes", data=io.BytesIO(b" " * (2 << 20)))
    _assert_error(resp.status, await resp.json(), 413)


async def test_good_bodies_reach_the_manager(client: Any) -> None:
    c, stub = client
    for path, body in [("/v2/sandboxes", {"templateID": "base", "timeout": 60.7}),
                       ("/sandboxes/abc-6532622b/connect", {"timeout": 30}), ("/sandboxes/abc/connect", None),
                       ("/sandboxes/abc/timeout", {"timeout": 0}), ("/sandboxes/abc/pause", None),
                       ("/sandboxes/abc/snapshots", {"name": "n"}), ("/sandboxes/abc/fork", {"count": 2})]:
        resp = await c.post(path, json=body) if body is not None else await c.post(path)
        _assert_error(resp.status, await resp.json(), 404)
    names = [name for name, _ in stub.calls]
    assert names == ["create", "connect", "connect", "set_timeout", "pause", "snapshot", "fork"], names
    assert stub.calls[0][1][0].timeout == 60 and stub.calls[1][1] == ("abc", 30)


async def test_memory_false_snapshots_and_forks_reach_the_manager(client: Any) -> None:
    c, stub = client  # filesystem-only snapshots and forks are served (tests/sandbox/test_files_only_copies.py)
    for path in ("/sandboxes/abc/snapshots", "/v2/sandboxes/abc/fork"):
        resp = await c.post(path, json={"memory": False})
        _assert_error(resp.status, await resp.json(), 404)  # the stub knows no sandbox: it was asked
    assert [name for name, _ in stub.calls[-2:]] == ["snapshot", "fork"]


@pytest.mark.parametrize("path", [
    "/v2/sandboxes?limit=abc", "/v2/sandboxes?limit=0", "/v2/sandboxes?limit=" + "9" * 5000,
    "/v2/sandboxes?order=up", "/v2/sandboxes?state=gone", "/v2/sandboxes?startedAfter=%00",
    "/v2/sandboxes?startedAfter=0001-01-01T00:00:00", "/v2/sandboxes?nextToken=%FF%FE",
    "/v2/sandboxes?metadata=a", "/sandboxes?metadata=a%26b",
    "/sandboxes/abc/metrics?start=x", "/sandboxes/abc/metrics?end=%FF",
    "/snapshots?limit=x", "/snapshots?nextToken=1.5", "/snapshots?limit=" + "9" * 5000,
    "/sandboxes/s1/events?after=-1", "/sandboxes/s1/events?after=x", "/sandboxes/s1/events?limit=0",
    "/sandboxes/s1/events?after=" + "9" * 30, "/sandboxes/s1/events?after=" + "9" * 5000,
    "/sandboxes/s1/events?verify=maybe",
])
async def test_bad_queries_are_400(client: Any, path: str) -> None:
    c, _ = client
    resp = await c.get(yarl.URL(path, encoded=True))
    _assert_error(resp.status, await resp.json(), 400)


@pytest.mark.parametrize("path", [
    "/v2/sandboxes?limit=5&order=ASC&state=running,,paused&startedAfter=2026-01-01T00:00:00%2B02:00",
    "/v2/sandboxes?metadata=&nextToken=", "/sandboxes?metadata=k%3Dv", "/snapshots?limit=-3&nextToken=",
    "/snapshots?sandboxID=x&name=y&limit=1000", "/health",
    "/sandboxes/s1/events?after=0&limit=99999&verify=TRUE", "/sandboxes/s1-6532622b/events?after=9223372036854775807",
    "/sandboxes/s1/lineage",
])
async def test_good_queries_are_200(client: Any, path: str) -> None:
    c, _ = client
    resp = await c.get(yarl.URL(path, encoded=True))
    assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("sid", ["%00", "a%00b", "%FF%FE", "%ED%A0%80", "-", "a" * 5000, "%2E%2E", "x%2Fy"])
async def test_odd_path_ids_are_404(client: Any, sid: str) -> None:
    c, _ = client
    for method, path in [("GET", "/sandboxes/{}"), ("DELETE", "/sandboxes/{}"), ("GET", "/sandboxes/{}/metrics"),
                         ("POST", "/sandboxes/{}/pause"), ("GET", "/sandboxes/{}/events"),
                         ("GET", "/sandboxes/{}/lineage"), ("DELETE", "/templates/{}")]:
        resp = await c.request(method, yarl.URL(path.format(sid), encoded=True))
        _assert_error(resp.status, await resp.json(), 404)
