"""The contract, keepstate/api/openapi.yaml (docs/openapi.yaml links to it), checked in both directions.

Requests: `Spec.check_request(method, template, body)` lists what a JSON request body gets wrong against its
operation's `requestBody` schema; the control plane's body readers (control.json_body, object_body) run it on every
body, so a body the contract refuses is a 400 naming the field before any handler looks at it (handlers then only
convert what the contract admitted).

Responses:
`Spec.check(method, path, status, headers, body)` lists what a response gets wrong: an undocumented status, a
missing or malformed documented header, a body that is not JSON or does not match the schema (formats included), an
error whose `code` is not its status. `validating_middleware()` runs that on every control-plane response when the
server has KEEPSTATE_VALIDATE_RESPONSES=1 and turns a violation into a 500 naming it (the tests run servers so);
without the variable it passes everything through untouched.

Needs PyYAML and jsonschema-rs, imported only when a Spec is loaded.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

log = logging.getLogger("keepstate.api.spec")
SPEC_PATH = Path(__file__).with_name("openapi.yaml")
ENV_VAR = "KEEPSTATE_VALIDATE_RESPONSES"
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def _template_key(path: str) -> str:
    """`/sandboxes/{sandbox_id}/fork` and `/sandboxes/{sandboxID}/fork` are the same route (and so is aiohttp's
    `{sandbox_id:regex}`)."""
    return re.sub(r"\{[A-Za-z_]\w*(?::[^{}]*)?\}", "{}", path)


@dataclass
class _Operation:
    method: str
    path: str
    responses: dict[str, Any]
    request: dict[str, Any] | None = None  # the requestBody's JSON schema, if it has one
    validators: dict[tuple[str, str], Any] = field(default_factory=dict)


class Spec:
    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self._ops: dict[tuple[str, str], _Operation] = {}
        self._paths: list[tuple[re.Pattern[str], str]] = []
        for path, item in doc.get("paths", {}).items():
            item = self._deref(item)
            key = _template_key(path)
            for method in METHODS:
                if method in item:
                    body = self._deref(item[method].get("requestBody") or {})
                    schema = ((body.get("content") or {}).get("application/json") or {}).get("schema")
                    self._ops[(method.upper(), key)] = _Operation(method.upper(), path, item[method]["responses"],
                                                                  schema)
            pattern = "^" + re.sub(r"\\\{[^}/]*\\\}", "[^/]+", re.escape(path)) + "$"
            self._paths.append((re.compile(pattern), key))
        # Literal paths first: /v2/sandboxes before anything templated of the same length.
        self._paths.sort(key=lambda p: p[1].count("{}"))
        self._error_validator = self._validator({"$ref": "#/components/schemas/Error"})

    @classmethod
    def load(cls, path: Path = SPEC_PATH) -> Spec:
        yaml: Any = importlib.import_module("yaml")
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: ten times faster
        with open(path, encoding="utf-8") as f:
            return cls(yaml.load(f, Loader=loader))

    @classmethod
    @functools.cache
    def default(cls) -> Spec:
        """keepstate/api/openapi.yaml, loaded once."""
        return cls.load()

    # -- lookup ---------------------------------------------------------------------
    def _deref(self, node: Any) -> Any:
        """Follow a local `$ref` (`#/components/...`) until the node is not one."""
        for _ in range(32):
            if not (isinstance(node, dict) and isinstance(node.get("$ref"), str)):
                return node
            ref = node["$ref"]
            if not ref.startswith("#/"):
                raise ValueError(f"only local references are supported, not {ref!r}")
            node = self.doc
            for part in ref[2:].split("/"):
                node = node[part.replace("~1", "/").replace("~0", "~")]
        raise ValueError("reference chain too long")

    def operation(self, method: str, path: str, template: str | None = None) -> _Operation | None:
        """The documented operation for a request: by its route's template if known, else by matching the path."""
        method = "GET" if method.upper() == "HEAD" else method.upper()
        if template is not None:
            return self._ops.get((method, _template_key(template)))
        for pattern, key in self._paths:
            if pattern.match(path) and (method, key) in self._ops:
                return self._ops[(method, key)]
        return None

    def _validator(self, schema: dict[str, Any]) -> Any:
        jsonschema_rs: Any = importlib.import_module("jsonschema_rs")
        # The schema is rooted in a copy of the document's components, so that `#/components/...` resolves.
        root = {**schema, "components": self.doc.get("components", {})}
        return jsonschema_rs.Draft202012Validator(root, validate_formats=True)

    def _response_validator(self, op: _Operation, status: str, what: str, schema: dict[str, Any]) -> Any:
        key = (status, what)
        if key not in op.validators:
            op.validators[key] = self._validator(schema)
        return op.validators[key]

    # -- checking -------------------------------------------------------------------
    def check_request(self, method: str, template: str, body: Any) -> list[str]:
        """What a request's JSON body gets wrong against its operation's schema (empty: it conforms, or the
        operation documents no JSON body)."""
        op = self._ops.get((method.upper(), _template_key(template)))
        if op is None or op.request is None:
            return []
        validator = self._response_validator(op, "request", "body", op.request)
        return [f"{_field(e.instance_path)}{e.message}" for e in validator.iter_errors(body)]

    def check(self, method: str, path: str, status: int, headers: Mapping[str, str], body: bytes | None,
              template: str | None = None) -> list[str]:
        """What the response gets wrong (empty: it conforms). `template` is the route's path template, if known."""
        op = self.operation(method, path, template)
        head = method.upper() == "HEAD"
        if op is None:
            # A route the contract does not describe (a 404 for an unknown path, a 405): only errors may come back,
            # and they are errors like every other.
            if status < 400:
                return [f"{method.upper()} {path} is not in the spec, yet answered {status}"]
            return [] if head else self._check_error(status, headers, body)
        label = f"{op.method} {op.path}"
        response = None
        for key in (str(status), f"{str(status)[0]}XX", "default"):
            if key in op.responses:
                response, status_key = self._deref(op.responses[key]), key
                break
        if response is None:
            documented = ", ".join(sorted(op.responses))
            return [f"{label}: status {status} is not documented (documented: {documented})"]
        problems = []
        for name, header in (response.get("headers") or {}).items():
            problems += self._check_header(op, status_key, name, self._deref(header), headers)
        content = response.get("content")
        if head:
            return problems
        if not content:
            if body:
                problems.append(f"{label} {status}: documented without a body, yet has {len(body)} bytes")
            return problems
        ctype = _content_type(headers)
        media = content.get(ctype) if ctype else None
        if media is None:
            problems.append(f"{label} {status}: content type {ctype or 'none'!r} is not documented "
                            f"({', '.join(content)})")
            return problems
        if "json" not in ctype:
            return problems
        try:
            value = json.loads(body or b"")
        except ValueError as exc:
            return [*problems, f"{label} {status}: body is not JSON ({exc})"]
        if "schema" in media:
            validator = self._response_validator(op, status_key, f"body {ctype}", media["schema"])
            problems += [f"{label} {status}: body{_where(e.instance_path)}: {e.message}"
                         for e in validator.iter_errors(value)]
        if status >= 400 and isinstance(value, dict) and value.get("code") != status:
            problems.append(f"{label} {status}: error body's code is {value.get('code')!r}, not the status")
        return problems

    def _check_error(self, status: int, headers: Mapping[str, str], body: bytes | None) -> list[str]:
        if _content_type(headers) != "application/json":
            return [f"error {status}: content type {_content_type(headers)!r} is not application/json"]
        try:
            value = json.loads(body or b"")
        except ValueError as exc:
            return [f"error {status}: body is not JSON ({exc})"]
        problems = [f"error {status}: body{_where(e.instance_path)}: {e.message}"
                    for e in self._error_validator.iter_errors(value)]
        if isinstance(value, dict) and value.get("code") != status:
            problems.append(f"error {status}: code is {value.get('code')!r}, not the status")
        return problems

    def _check_header(self, op: _Operation, status: str, name: str, header: dict[str, Any],
                      headers: Mapping[str, str]) -> list[str]:
        label = f"{op.method} {op.path} {status}"
        raw = _header(headers, name)
        if raw is None:
            return [f"{label}: required header {name} is missing"] if header.get("required") else []
        schema = self._deref(header.get("schema") or {})
        kind = schema.get("type")
        value = _header_value(raw, kind)
        if value is None:
            return [f"{label}: header {name}: {raw!r} is not of type {kind}"]
        validator = self._response_validator(op, status, f"header {name}", schema)
        return [f"{label}: header {name}: {e.message}" for e in validator.iter_errors(value)]


def _header_value(raw: str, kind: Any) -> Any:
    """A header's text as the JSON value its schema describes (None: it is not one)."""
    if kind == "integer":
        return int(raw) if re.fullmatch(r"-?[0-9]+", raw) else None
    if kind == "number":
        try:
            value = float(raw)
        except ValueError:
            return None
        return value if math.isfinite(value) else None
    if kind == "boolean":
        return {"true": True, "false": False}.get(raw)
    return raw


def _field(path: Any) -> str:
    """`timeout`: , `network.allowOut[2]`: , or nothing for the body itself."""
    if not path:
        return ""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return f"`{out}`: "


def _where(path: Any) -> str:
    return "".join(f"[{p!r}]" for p in path) if path else ""


def _header(headers: Mapping[str, str], name: str) -> str | None:
    found = headers.get(name)
    if found is not None:
        return found
    low = name.lower()
    for k, v in headers.items():
        if k.lower() == low:
            return v
    return None


def _content_type(headers: Mapping[str, str]) -> str:
    raw = _header(headers, "Content-Type") or ""
    return raw.split(";")[0].strip().lower()


# -- the middleware ---------------------------------------------------------------------
def enabled_by_env() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes")


def validating_middleware(spec: Spec | None = None, enabled: bool | None = None) -> Middleware:
    """An aiohttp middleware that checks control-plane responses against the spec, when `enabled` (default: the
    environment has KEEPSTATE_VALIDATE_RESPONSES=1); a violation becomes a 500 naming it, and is logged.

    Put it first (outermost) in the app's middlewares, so that it sees the error responses the dispatch
    middleware renders too. Disabled, it only passes requests on.
    """
    from .router import is_data_plane  # here: the router's handlers read bodies through control, which uses Spec

    if enabled is None:
        enabled = enabled_by_env()

    if not enabled:
        @web.middleware
        async def passthrough(request: web.Request, handler: Handler) -> web.StreamResponse:
            return await handler(request)

        return passthrough

    checked = spec or Spec.default()

    @web.middleware
    async def validate_response(request: web.Request, handler: Handler) -> web.StreamResponse:
        if is_data_plane(request):
            return await handler(request)
        response = await handler(request)
        if not isinstance(response, web.Response) or response.prepared:
            return response  # streamed: nothing to read back
        body = response.body
        if body is not None and not isinstance(body, bytes | bytearray):
            return response
        resource = request.match_info.route.resource
        template = resource.canonical if resource is not None else None
        problems = checked.check(request.method, request.path, response.status, response.headers,
                                 bytes(body) if body is not None else None, template)
        if not problems:
            return response
        message = "response violates docs/openapi.yaml: " + "; ".join(problems)
        log.error("%s %s -> %s: %s", request.method, request.path_qs, response.status, message)
        return web.json_response({"code": 500, "message": message}, status=500, headers={"Should-Retry": "false"})

    return validate_response
