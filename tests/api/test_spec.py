"""docs/openapi.yaml is a valid OpenAPI 3.1 document that describes every route we serve, and keepstate.api.spec
holds responses to it (directly and as the KEEPSTATE_VALIDATE_RESPONSES middleware)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from keepstate.api import control, events, logs, schemas, spec
from keepstate.api import nodes as nodes_routes
from keepstate.api import secrets as secret_routes
from keepstate.api import template_builds as build_routes
from keepstate.api import templates as template_routes
from keepstate.api import volumes as volume_routes

REPO = Path(__file__).resolve().parents[2]
JSON = {"Content-Type": "application/json; charset=utf-8"}
HEALTH = {"status": "ok", "message": "Health check successful", "pools": {"base": 1},
          "poolClaims": {"base": 4}, "running": 0,
          "admission": {"starts": {"running": 1, "waiting": 0, "refillsWaiting": 1, "limit": 4, "queue": 16,
                                   "waitSeconds": 30.0, "refused": 0, "retryAfter": 2},
                        "sandboxes": {"onHost": 3, "limit": 376, "perKeyLimit": 100}}, "teardowns": 0}
SANDBOX = {"templateID": "base", "sandboxID": "abc123", "alias": "base", "clientID": "6532622b",
           "envdVersion": "0.6.13", "envdAccessToken": "t", "trafficAccessToken": None, "domain": None}


@pytest.fixture(scope="module")
def contract() -> spec.Spec:
    return spec.Spec.default()


def body(value: Any) -> bytes:
    return json.dumps(value).encode()


def test_docs_openapi_is_the_packaged_file() -> None:
    docs = REPO / "docs" / "openapi.yaml"
    assert docs.is_symlink() and docs.resolve() == spec.SPEC_PATH.resolve()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"*.yaml"' in pyproject.split("[tool.setuptools.package-data]")[1].split("\n[")[0]


def test_it_is_valid_openapi_3_1(contract: spec.Spec) -> None:
    definitions = pytest.importorskip("schemathesis.specs.openapi.definitions")
    errors = [f"{list(e.instance_path)}: {e.message}" for e in definitions.OPENAPI_31_VALIDATOR.iter_errors(
        contract.doc)]
    assert not errors, errors


def _served_routes() -> set[tuple[str, str]]:
    out = set()
    for table in (control.routes, events.routes, logs.routes, template_routes.routes, volume_routes.routes,
                  secret_routes.routes, build_routes.routes, nodes_routes.routes):
        for route in table:
            method = getattr(route, "method", None)
            if method and method != "*":
                out.add((method, spec._template_key(route.path)))  # type: ignore[attr-defined]
    return out


def test_every_served_route_is_documented_and_every_documented_one_served(contract: spec.Spec) -> None:
    served = _served_routes()
    documented = {(op.method, spec._template_key(op.path)) for op in contract._ops.values()}
    assert served - documented == set(), "routes missing from docs/openapi.yaml"
    assert documented - served == set(), "documented routes that are not served"


def test_every_operation_documents_its_errors(contract: spec.Spec) -> None:
    for op in contract._ops.values():
        assert "500" in op.responses, op.path
        if op.path != "/health":
            assert "401" in op.responses, f"{op.method} {op.path}"
        for status, response in op.responses.items():
            if status >= "400":
                schema = contract._deref(response)["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/Error"}, (op.path, status)


def test_a_good_response_passes(contract: spec.Spec) -> None:
    assert contract.check("GET", "/health", 200, JSON, body(HEALTH)) == []
    assert contract.check("HEAD", "/health", 200, JSON, b"") == []
    assert contract.check("POST", "/v2/sandboxes", 201, JSON, body(SANDBOX)) == []
    assert contract.check("POST", "/sandboxes/abc-6532622b/connect", 200, JSON, body(SANDBOX)) == []
    assert contract.check("DELETE", "/sandboxes/abc", 204, {}, None) == []
    assert contract.check("POST", "/sandboxes/abc/fork", 201, JSON, body(
        [{"sandbox": SANDBOX}, {"error": {"code": 503, "message": "no free network slots"}}])) == []
    assert contract.check("GET", "/v2/sandboxes", 200, {**JSON, "X-Total-Running": "3", "X-Next-Token": "abc"},
                          body([])) == []
    assert contract.check("GET", "/snapshots", 200, JSON, body([{"snapshotID": "s", "names": ["s"]}])) == []
    error = body({"code": 404, "message": "sandbox \"x\" not found"})
    assert contract.check("GET", "/sandboxes/x", 404, JSON, error) == []
    assert contract.check("DELETE", "/templates/snap%2Fx", 404, JSON, error) == []
    # Not in the spec, but errors shaped like every other error: fine.
    assert contract.check("GET", "/nowhere", 404, JSON, error.replace(b"404", b"404")) == []
    assert contract.check("PUT", "/sandboxes/x", 405, JSON, body({"code": 405, "message": "Method Not Allowed"})) \
        == []
    busy = body({"code": 503, "message": "this host is busy starting sandboxes"})
    assert contract.check("POST", "/v2/sandboxes", 503, {**JSON, "Should-Retry": "true", "Retry-After": "3"},
                          busy) == []
    assert contract.check("POST", "/sandboxes/abc/connect", 429, {**JSON, "Should-Retry": "false"},
                          body({"code": 429, "message": "API key 'ci' has reached its limit"})) == []


@pytest.mark.parametrize("method,path,status,headers,payload,expect", [
    ("GET", "/health", 200, JSON, {**HEALTH, "running": "0"}, '"0" is not of type "integer"'),
    ("GET", "/health", 200, JSON, {k: v for k, v in HEALTH.items() if k != "pools"}, "pools"),
    ("POST", "/v2/sandboxes", 201, JSON, {**SANDBOX, "sandboxID": 5}, "sandboxID"),
    ("POST", "/v2/sandboxes", 201, {"Content-Type": "text/plain"}, SANDBOX, "content type"),
    ("POST", "/v2/sandboxes", 200, JSON, SANDBOX, "status 200 is not documented"),
    ("GET", "/sandboxes/abc", 418, JSON, {"code": 418, "message": "teapot"}, "status 418 is not documented"),
    ("GET", "/sandboxes/abc", 404, JSON, {"code": 400, "message": "x"}, "not the status"),
    ("GET", "/sandboxes/abc", 404, JSON, {"message": "x"}, "code"),
    ("GET", "/sandboxes/abc", 404, JSON, "not found", "type"),
    ("GET", "/v2/sandboxes", 200, JSON, [], "X-Total-Running is missing"),
    ("GET", "/v2/sandboxes", 200, {**JSON, "X-Total-Running": "many"}, [], "X-Total-Running"),
    ("GET", "/v2/sandboxes", 200, {**JSON, "X-Total-Running": "-1"}, [], "X-Total-Running"),
    ("GET", "/sandboxes/abc/metrics", 200, JSON, [{"timestamp": "yesterday", "timestampUnix": 1, "cpuCount": 1,
                                                   "cpuUsedPct": 0.5, "memUsed": 1, "memTotal": 2, "memCache": 0,
                                                   "diskUsed": 1, "diskTotal": 2}], "date-time"),
    ("DELETE", "/sandboxes/abc", 204, JSON, {"ok": True}, "without a body"),
    ("POST", "/sandboxes/abc/fork", 201, JSON, [{"sandbox": SANDBOX, "error": {"code": 500, "message": "x"}}],
     "oneOf"),
    ("GET", "/nowhere", 200, JSON, {}, "not in the spec"),
    ("GET", "/nowhere", 404, {"Content-Type": "text/plain"}, "404: Not Found", "application/json"),
    ("GET", "/sandboxes/abc", 500, JSON, {"code": 500, "message": "boom"}, "Should-Retry is missing"),
    ("GET", "/sandboxes/abc", 500, {**JSON, "Should-Retry": "true"}, {"code": 500, "message": "boom"},
     "Should-Retry"),
    ("POST", "/v2/sandboxes", 503, {**JSON, "Should-Retry": "true", "Retry-After": "soon"},
     {"code": 503, "message": "busy"}, "Retry-After"),
    ("GET", "/health", 200, JSON, {k: v for k, v in HEALTH.items() if k != "admission"}, "admission"),
])
def test_a_bad_response_fails(contract: spec.Spec, method: str, path: str, status: int,
                              headers: dict[str, str], payload: Any, expect: str) -> None:
    raw = payload.encode() if isinstance(payload, str) and "json" not in headers["Content-Type"] else body(payload)
    problems = contract.check(method, path, status, headers, raw)
    assert problems and any(expect in p for p in problems), problems


def test_what_the_renderers_produce_conforms(contract: spec.Spec) -> None:
    from tests.api.test_schemas import row  # the one place that knows how a SandboxRow is made

    now = time.time()
    running, paused = row("a" * 20, now, tag="x"), row("b" * 20, now - 5, state="paused")
    for r in (running, paused):
        assert contract.check("GET", f"/sandboxes/{r.sandbox_id}", 200, JSON,
                              body(schemas.detail(r, "0.6.13"))) == []
        assert contract.check("POST", "/v2/sandboxes", 201, JSON, body(schemas.sandbox(r, "0.6.13"))) == []
    assert contract.check("GET", "/v2/sandboxes", 200, {**JSON, "X-Total-Running": "1"},
                          body([schemas.listed(r, "0.6.13") for r in (running, paused)])) == []


# -- the middleware -----------------------------------------------------------------------------------------------
async def _health_ok(request: web.Request) -> web.Response:
    return web.json_response(HEALTH)


async def _health_bad(request: web.Request) -> web.Response:
    return web.json_response({**HEALTH, "running": "none"})


async def _undocumented_status(request: web.Request) -> web.Response:
    return web.json_response({"code": 418, "message": "teapot"}, status=418)


async def _kill(request: web.Request) -> web.Response:
    return web.Response(status=204)


def _app(**kwargs: Any) -> web.Application:
    app = web.Application(middlewares=[spec.validating_middleware(**kwargs)])
    app.router.add_get("/health", _health_bad)
    app.router.add_get("/v2/sandboxes", _health_ok)  # a body that is no list
    app.router.add_get("/sandboxes/{sandbox_id}", _undocumented_status)
    app.router.add_delete("/sandboxes/{sandbox_id}", _kill)
    app.router.add_get("/files", _health_bad)
    return app


@pytest.fixture
async def validating() -> AsyncIterator[TestClient[web.Request, web.Application]]:
    async with TestClient(TestServer(_app(enabled=True))) as c:
        yield c


async def test_middleware_turns_a_violation_into_a_500(validating: TestClient[web.Request, web.Application],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    for path in ("/health", "/v2/sandboxes", "/sandboxes/abc"):
        resp = await validating.get(path)
        payload = await resp.json()
        assert resp.status == 500 and payload["code"] == 500, payload
        assert payload["message"].startswith("response violates docs/openapi.yaml: "), payload
        assert resp.headers["Should-Retry"] == "false"
    assert "violates docs/openapi.yaml" in caplog.text
    resp = await validating.delete("/sandboxes/abc")
    assert resp.status == 204


async def test_middleware_leaves_the_data_plane_alone(validating: TestClient[web.Request, web.Application]) -> None:
    for headers in ({"E2b-Sandbox-Id": "abc", "E2b-Sandbox-Port": "49983"}, {"Host": "49983-abc.localhost"}):
        resp = await validating.get("/health", headers=headers)
        assert resp.status == 200 and (await resp.json())["running"] == "none"
    resp = await validating.get("/files?path=/x&signature=v1_abc")
    assert resp.status == 200


async def test_middleware_is_off_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(spec.ENV_VAR, raising=False)
    async with TestClient(TestServer(_app())) as c:
        assert (await c.get("/health")).status == 200
    monkeypatch.setenv(spec.ENV_VAR, "1")
    async with TestClient(TestServer(_app())) as c:
        assert (await c.get("/health")).status == 500
