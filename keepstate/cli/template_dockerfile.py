"""`keepstate template build --dockerfile`: a Dockerfile's steps through E2B's build protocol, logs streamed.

The client half of docs/design/template-builds.md, as the SDK's `Template.build` does it: request a build, upload
each COPY's files unless the server has them, start the build, then poll its status and print every log entry.
"""

from __future__ import annotations

import time
import urllib.parse
import urllib.request
from pathlib import Path

import click

from keepstate.builds.dockerfile import pack, parse
from keepstate.errors import NotFound

from .common import RemoteError
from .sandbox import _OPENER, Api, _default_key

POLL = 0.5


def _quote(s: str) -> str:
    return urllib.parse.quote(s, safe="")


def build_dockerfile(dockerfile: Path, name: str, context: Path, ready_cmd: str | None, force: bool,
                     cpu: int | None, memory_mb: int | None, api_url: str, api_key: str | None) -> int:
    """Run the build; 0 when the template is ready, 1 when the build failed (its reason on stderr)."""
    parsed = parse(dockerfile.read_text())
    api = Api(api_url, api_key or _default_key())
    try:
        api.call("GET", f"/templates/aliases/{_quote(parsed.base)}")
        is_template = True
    except (RemoteError, NotFound) as exc:
        if isinstance(exc, RemoteError) and exc.status != 404:
            raise
        is_template = False
    request: dict[str, object] = {"name": name}
    if cpu:
        request["cpuCount"] = cpu
    if memory_mb:
        request["memoryMB"] = memory_mb
    info, _ = api.call("POST", "/v3/templates", request)
    template_id, build_id = info["templateID"], info["buildID"]
    click.echo(f"template {name}: {template_id}, build {build_id}", err=True)
    for step in parsed.steps:
        if step["type"] != "COPY":
            continue
        args = step["args"]
        assert isinstance(args, list)
        data, files_hash = pack(context, args[0], args[1])
        step["filesHash"] = files_hash
        link, _ = api.call("GET", f"/templates/{_quote(template_id)}/files/{files_hash}")
        if not link.get("present") and link.get("url"):
            req = urllib.request.Request(link["url"], data=data, method="PUT",
                                         headers={"Content-Length": str(len(data))})
            with _OPENER.open(req, timeout=600):
                pass
            click.echo(f"uploaded {args[0]} ({len(data)} bytes)", err=True)
    api.call("POST", f"/v2/templates/{_quote(template_id)}/builds/{build_id}",
             parsed.body(ready_cmd, force, is_template))
    offset = 0
    started = time.monotonic()
    while True:
        status, _ = api.call("GET", f"/templates/{_quote(template_id)}/builds/{build_id}/status?logsOffset={offset}")
        for entry in status.get("logEntries") or []:
            click.echo(f"{time.monotonic() - started:6.1f}s {entry['level']:<5} {entry['message']}")
        offset += len(status.get("logEntries") or [])
        if status["status"] in ("ready", "error") and not status.get("logEntries"):
            break
        time.sleep(POLL)
    if status["status"] == "error":
        reason = status.get("reason") or {}
        click.echo(f"build failed at step {reason.get('step', '?')}: {reason.get('message', '')}", err=True)
        return 1
    click.echo(f"{name} ready ({template_id}, build {build_id}) in {time.monotonic() - started:.1f}s", err=True)
    return 0
