"""`keepstate sandbox`: list, create, exec in, pause, resume and kill sandboxes of a running server."""

from __future__ import annotations

import base64
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import click

from keepstate.config import home
from keepstate.errors import BadRequest, KeepStateError, Unauthorized, Unavailable
from keepstate.ports import AGENT_PORT, API_PORT

from .common import Group, RemoteError, emit_json, json_option

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Api:
    def __init__(self, url: str, key: str) -> None:
        self.url = url.rstrip("/")
        self.key = key

    def call(self, method: str, path: str, body: object | None = None) -> tuple[Any, dict[str, str]]:
        """One API call; an error answer raises RemoteError carrying the server's JSON error unchanged."""
        if not self.key:
            raise Unauthorized("no API key: pass --api-key, set E2B_API_KEY, or create one with "
                               "`keepstate keys create NAME`")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"X-API-KEY": self.key, "Content-Type": "application/json"})
        try:
            with _OPENER.open(req, timeout=600) as r:
                raw = r.read()
                return (json.loads(raw) if raw else None), dict(r.headers)
        except urllib.error.HTTPError as e:
            try:
                answer = json.loads(e.read())
            except ValueError:
                answer = None
            if not isinstance(answer, dict) or "message" not in answer:
                answer = {"code": e.code, "message": str(e.reason)}
            raise RemoteError(e.code, answer, f"{method} {path}") from None
        except urllib.error.URLError as e:
            raise Unavailable(f"cannot reach the KeepState server at {self.url} ({e.reason}); is `keepstate serve` "
                              "running? (--api-url / E2B_API_URL)") from None


def _default_key() -> str:
    if os.environ.get("E2B_API_KEY"):
        return os.environ["E2B_API_KEY"]
    path = home() / "dev-api-key"
    try:
        return path.read_text().strip()
    except OSError:
        return ""


@click.group(cls=Group)
@click.option("--api-url", envvar="E2B_API_URL", default=f"http://127.0.0.1:{API_PORT}", show_default=True,
              help="The KeepState server (E2B_API_URL).")
@click.option("--api-key", envvar="E2B_API_KEY", default=None,
              help="API key (E2B_API_KEY; default: the development key `make up` created).")
@click.pass_context
def sandbox(ctx: click.Context, api_url: str, api_key: str | None) -> None:
    """List, create, exec in, pause, resume and kill sandboxes.

    \b
    Examples:
      keepstate sandbox create --template base --timeout 600 --env FOO=bar
      keepstate sandbox exec <id> -- uname -a
      keepstate sandbox ls --json
      keepstate sandbox pause <id>; keepstate sandbox resume <id>
      keepstate sandbox kill <id>

    Errors are the server's: with --json its error object {"code", "message"} on stdout as it sent it, else
    `error: MESSAGE` on stderr; exit 2 for a refused request (400), 3 for an unknown sandbox (404), 4 otherwise.
    """
    ctx.obj = Api(api_url, api_key or _default_key())  # a missing key is reported by the first call


@sandbox.command("ls")
@click.option("--state", default="running,paused", show_default=True)
@json_option()
@click.pass_obj
def ls(api: Api, state: str, as_json: bool) -> None:
    """List sandboxes (newest first)."""
    rows: list[dict[str, Any]] = []
    token = ""
    while True:
        page, headers = api.call("GET", f"/v2/sandboxes?state={state}&limit=100"
                                 + (f"&nextToken={token}" if token else ""))
        rows.extend(page)
        token = headers.get("X-Next-Token", "")
        if not token:
            break
    if as_json:
        emit_json(rows)
        return
    click.echo(f"{'SANDBOX ID':<22} {'TEMPLATE':<20} {'STATE':<8} {'STARTED':<20} {'ENDS':<20}")
    for r in rows:
        click.echo(f"{r['sandboxID']:<22} {r['templateID']:<20} {r['state']:<8} {r['startedAt'][:19]:<20} "
                   f"{r['endAt'][:19]:<20}")


def _pairs(values: tuple[str, ...], what: str) -> dict[str, str]:
    out = {}
    for v in values:
        if "=" not in v:
            raise BadRequest(f"{what} must look like KEY=VALUE, got {v!r}")
        k, val = v.split("=", 1)
        out[k] = val
    return out


@sandbox.command("create")
@click.option("--template", default="base", show_default=True)
@click.option("--timeout", default=300, show_default=True, type=int, help="Seconds until it is killed.")
@click.option("--metadata", "-m", multiple=True, help="KEY=VALUE, repeatable.")
@click.option("--env", "-e", multiple=True, help="KEY=VALUE for every process, repeatable.")
@click.option("--auto-pause", is_flag=True, help="Pause instead of kill at the timeout.")
@json_option(help="Print the whole response as JSON (errors as {\"code\", \"message\"}).")
@click.pass_obj
def create(api: Api, template: str, timeout: int, metadata: tuple[str, ...], env: tuple[str, ...],
           auto_pause: bool, as_json: bool) -> None:
    """Create a sandbox and print its ID."""
    body = {"templateID": template, "timeout": timeout, "metadata": _pairs(metadata, "--metadata"),
            "envVars": _pairs(env, "--env"), "autoPause": auto_pause}
    out, _ = api.call("POST", "/v2/sandboxes", body)
    if as_json:
        emit_json(out)
    else:
        click.echo(out["sandboxID"])


@sandbox.command("kill")
@click.argument("sandbox_ids", nargs=-1, required=True)
@click.pass_obj
def kill(api: Api, sandbox_ids: tuple[str, ...]) -> None:
    """Kill sandboxes (running or paused)."""
    for sid in sandbox_ids:
        api.call("DELETE", f"/sandboxes/{sid}")
        click.echo(f"killed {sid}", err=True)


@sandbox.command("pause")
@click.argument("sandbox_id")
@click.pass_obj
def pause(api: Api, sandbox_id: str) -> None:
    """Checkpoint a sandbox (memory, processes, files) into the store and stop it."""
    t = time.monotonic()
    api.call("POST", f"/sandboxes/{sandbox_id}/pause", {})
    click.echo(f"paused {sandbox_id} in {time.monotonic() - t:.2f}s", err=True)


@sandbox.command("resume")
@click.argument("sandbox_id")
@click.option("--timeout", default=300, show_default=True, type=int)
@click.pass_obj
def resume(api: Api, sandbox_id: str, timeout: int) -> None:
    """Resume a paused sandbox from its checkpoint (on this server or any sharing the store)."""
    t = time.monotonic()
    api.call("POST", f"/v2/sandboxes/{sandbox_id}/connect", {"timeout": timeout})
    click.echo(f"running {sandbox_id} ({time.monotonic() - t:.2f}s)", err=True)


@sandbox.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--user", default=None, help="Run as this user (default: the template's).")
@click.option("--cwd", default=None)
@click.pass_obj
def exec_(api: Api, sandbox_id: str, command: tuple[str, ...], user: str | None, cwd: str | None) -> None:
    """Run COMMAND in a sandbox, streaming its output; exits with its exit code.

    \b
    Example: keepstate sandbox exec 3omqr7s0uqrd8orzmkq3 -- python3 -c 'print(6*7)'
    """
    import shlex

    from connectrpc.errors import ConnectError
    from protobuf import Oneof

    from keepstate.agent.proto.process.process_connect import ProcessClientSync
    from keepstate.agent.proto.process.process_pb import ProcessConfig, ProcessEvent, StartRequest

    info, _ = api.call("POST", f"/v2/sandboxes/{sandbox_id}/connect", {})
    headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(AGENT_PORT)}
    if info.get("envdAccessToken"):
        headers["X-Access-Token"] = info["envdAccessToken"]
    if user:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:".encode()).decode()
    client = ProcessClientSync(api.url)
    line = " ".join(shlex.quote(c) for c in command)
    config = ProcessConfig(cmd="/bin/bash", args=["-l", "-c", line], envs={}, cwd=cwd) if cwd else \
        ProcessConfig(cmd="/bin/bash", args=["-l", "-c", line], envs={})
    code = 1
    try:
        for resp in client.start(StartRequest(process=config, stdin=False), headers=headers, timeout_ms=None):
            match resp.event.event if resp.event else None:
                case Oneof(field="data", value=ProcessEvent.DataEvent() as data):
                    match data.output:
                        case Oneof(field="stdout", value=chunk):
                            sys.stdout.buffer.write(chunk)
                            sys.stdout.flush()
                        case Oneof(field="stderr", value=chunk):
                            sys.stderr.buffer.write(chunk)
                            sys.stderr.flush()
                case Oneof(field="end", value=ProcessEvent.EndEvent() as end):
                    code = end.exit_code
    except ConnectError as exc:
        raise KeepStateError(f"exec in {sandbox_id}: {exc}") from None
    sys.exit(code if 0 <= code < 256 else 1)
