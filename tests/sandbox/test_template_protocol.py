"""E2B's template build protocol up to the build itself, on the fake runtime (no step runs here: builds run on
gVisor in tests/sdk/test_template_build.py): requests, signed uploads, clear errors. (A version 3 catalog.sqlite,
from before the template tables, imported into the database: tests/db/test_legacy_catalog.py.)"""

from __future__ import annotations

import gzip
import io
import tarfile

from .conftest import Served

HASH = "ab" * 32


def _tar(gz: bool) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("x.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"x\n"))
    return gzip.compress(buf.getvalue()) if gz else buf.getvalue()


async def test_request_upload_and_its_errors(served: Served) -> None:
    status, info = await served.call("POST", "/v3/templates", {"name": "my-app:v2", "tags": ["latest"],
                                                                "cpuCount": 2, "memoryMB": 1024})
    assert status == 202
    assert info["names"] == ["my-app"] and info["tags"] == ["v2", "latest"] and not info["public"]
    tid = info["templateID"]
    status, again = await served.call("POST", "/v3/templates", {"name": "my-app"})
    assert status == 202 and again["templateID"] == tid and again["buildID"] != info["buildID"]

    status, link = await served.call("GET", f"/templates/{tid}/files/{HASH}")
    assert status == 201 and link["present"] is False and link["url"].startswith(served.url)
    async with served.http.put(link["url"], data=_tar(gz=True)) as r:  # no API key: the URL is signed
        assert r.status == 201
    status, link2 = await served.call("GET", f"/templates/{tid}/files/{HASH}")
    assert link2["present"] is True
    async with served.http.put(link["url"].replace("signature=", "signature=f"), data=_tar(gz=False)) as r:
        assert r.status == 401 and "signature" in (await r.json())["message"]
    async with served.http.put(link["url"], data=b"hello, not a tar") as r:
        assert r.status == 400 and "tar" in (await r.json())["message"]
    async with served.http.put(link["url"], data=_tar(gz=False)) as r:  # a plain tar is fine too
        assert r.status == 201

    build = f"/v2/templates/{tid}/builds/{info['buildID']}"
    for body, code, words in [
        ({"steps": [{"type": "FROB", "args": []}]}, 400, "step 1"),
        ({"steps": [{"type": "COPY", "args": ["a", "/a"], "filesHash": "cd" * 32}]}, 400, "never uploaded"),
        ({"fromTemplate": "a", "fromImage": "b"}, 400, "not both"),
    ]:
        status, err = await served.call("POST", build, body)
        assert (status, words in err["message"]) == (code, True), err
    status, err = await served.call("POST", f"/v2/templates/{tid}/builds/00000000-0000-0000-0000-000000000000",
                                    {"steps": []})
    assert status == 404
    status, st = await served.call("GET", f"/templates/{tid}/builds/{info['buildID']}/status?logsOffset=0")
    assert status == 200 and st["status"] == "waiting" and st["logEntries"] == []


async def test_names_tags_and_deletes(served: Served) -> None:
    status, err = await served.call("POST", "/v3/templates", {"name": "base"})
    assert status == 409 and "base" in err["message"]
    status, err = await served.call("POST", "/v3/templates", {"name": "Bad Name!"})
    assert status == 400
    status, info = await served.call("POST", "/v3/templates", {"name": "team/tool"})
    assert status == 202
    status, _ = await served.call("GET", "/templates/aliases/team%2Ftool")
    assert status == 200  # Template.exists finds it by name while its first build runs
    status, _ = await served.call("POST", "/templates/tags", {"target": "team/tool:default", "tags": ["v1"]})
    assert status == 404  # no ready build to point at
    status, tags = await served.call("GET", f"/templates/{info['templateID']}/tags")
    assert status == 200 and tags == []
    status, listed = await served.call("GET", "/templates")
    assert status == 200 and "team/tool" in {n for t in listed for n in t["names"]}
    status, _ = await served.call("DELETE", "/templates/team%2Ftool")
    assert status == 204
    status, _ = await served.call("GET", "/templates/aliases/team%2Ftool")
    assert status == 404



async def test_a_builds_log_entries_by_time_and_level(served: Served) -> None:
    """E2B's logs route (`GET /templates/{id}/builds/{build}/logs`): the entries the status route carries, by
    `cursor` (ms), `direction`, `level` and `limit`."""
    from keepstate.api.template_builds import BUILDS
    from keepstate.builds.service import BuildLog

    status, info = await served.call("POST", "/v3/templates", {"name": "logged"})
    assert status == 202
    base = f"/templates/{info['templateID']}/builds/{info['buildID']}/logs"
    log = served.app[BUILDS].logs.setdefault(info["buildID"], BuildLog())
    for i, (second, level) in enumerate([(1, "debug"), (2, "info"), (3, "warn"), (4, "error")]):
        log.entries.append({"timestamp": f"2026-12-05T10:00:0{second}Z", "level": level, "message": f"m{i}"})
    at = 1_796_464_802_000  # 2026-12-05T10:00:02Z in ms

    async def messages(query: str) -> list[str]:
        status, body = await served.call("GET", base + query)
        assert status == 200, body
        return [e["message"] for e in body["logs"]]

    assert await messages("") == ["m0", "m1", "m2", "m3"]
    assert await messages("?level=warn") == ["m2", "m3"]
    assert await messages(f"?cursor={at}") == ["m1", "m2", "m3"]
    assert await messages(f"?cursor={at}&direction=backward") == ["m1", "m0"]
    assert await messages("?direction=backward&limit=1") == ["m3"]
    for bad in ("?limit=0", "?cursor=soon", "?direction=sideways", "?level=loud", "?source=elsewhere"):
        status, body = await served.call("GET", base + bad)
        assert status == 400, (bad, body)
    assert (await served.call("GET", f"/templates/{info['templateID']}/builds/nope/logs"))[0] == 404
