"""Templates built with the stock SDK's `Template()` (and the CLI's --dockerfile), on real gVisor sandboxes
(docs/design/template-builds.md). Builds are few: one full build shared by the module, its cached rebuild, one
background build with skip_cache, one Dockerfile build on top of it, and failures that stop at their first step.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import os
import subprocess
import tarfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2b import Sandbox, Template, wait_for_port
from e2b.exceptions import BuildException

from sdkharness import KEEPSTATE, Server

PORT = 8123


def _name(what: str) -> str:
    return f"ks-test-{what}-{uuid.uuid4().hex[:8]}"


def _context(root: Path) -> Path:
    ctx = root / "ctx"
    (ctx / "folder" / "inner").mkdir(parents=True)
    (ctx / "one.txt").write_text("one file\n")
    (ctx / "folder" / "a.txt").write_text("a\n")
    (ctx / "folder" / "inner" / "b.sh").write_text("#!/bin/sh\necho b\n")
    (ctx / "links").mkdir()
    (ctx / "links" / "target.txt").write_text("pointed at\n")
    (ctx / "links" / "ln").symlink_to("target.txt")
    return ctx


def _template(ctx: Path) -> Any:
    return (Template(file_context_path=str(ctx))
            .from_base_image()
            .copy("one.txt", "/home/user/one.txt")
            .copy("folder", "/opt/folder/", mode=0o750)
            .copy("links", "/home/user/kept/")
            .copy("links", "/home/user/resolved/", resolve_symlinks=True)
            .run_cmd("whoami > /tmp/root-whoami", user="root")
            .run_cmd("whoami > /home/user/user-whoami")
            .set_envs({"GREETING": "hello there"})
            .set_workdir("/home/user/work")
            .set_user("user")
            .run_cmd("pwd > /home/user/pwd-at-build && echo \"$GREETING\" > /home/user/env-at-build")
            .set_start_cmd(f"python3 -m http.server {PORT}", wait_for_port(PORT)))


class Built:
    def __init__(self, name: str, ctx: Path, logs: list[Any]) -> None:
        self.name, self.ctx, self.logs = name, ctx, logs


@pytest.fixture(scope="module")
def built(e2b_env: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    ctx = _context(tmp_path_factory.mktemp("tpl"))
    # Each instance of this fixture (one per xdist worker running this module, all on the shared server) builds
    # cold: a copied file of its own, so one worker's build is not the other's cache hit.
    (ctx / "folder" / "inner" / ".nonce").write_text(uuid.uuid4().hex)
    name = _name("full")
    logs: list[Any] = []
    Template.build(_template(ctx), name, cpu_count=1, memory_mb=1024, on_build_logs=logs.append)
    yield Built(name, ctx, logs)


def test_a_sandbox_of_the_template_has_its_files_users_env_and_start_process(built: Built) -> None:
    sbx = Sandbox.create(built.name, timeout=120)
    try:
        # The start process runs at once: it was running when the template was snapshotted.
        up = sbx.commands.run(f"curl -s -o /dev/null -w '%{{http_code}}' http://127.0.0.1:{PORT}/")
        assert up.stdout == "200"
        r = sbx.commands.run("cat /home/user/one.txt /opt/folder/a.txt; /opt/folder/inner/b.sh; "
                             "stat -c '%U %a' /home/user/one.txt /opt/folder/inner/b.sh")
        assert r.stdout.splitlines() == ["one file", "a", "b", "user 644", "user 750"]
        kept = sbx.commands.run("readlink /home/user/kept/ln; cat /home/user/kept/ln; "
                                "test -L /home/user/resolved/ln || echo regular; cat /home/user/resolved/ln")
        assert kept.stdout.splitlines() == ["target.txt", "pointed at", "regular", "pointed at"]
        who = sbx.commands.run("cat /tmp/root-whoami /home/user/user-whoami /home/user/pwd-at-build "
                               "/home/user/env-at-build")
        assert who.stdout.splitlines() == ["root", "user", "/home/user/work", "hello there"]
        now = sbx.commands.run('echo "$GREETING"; pwd; whoami')
        assert now.stdout.splitlines() == ["hello there", "/home/user/work", "user"]
        assert sbx.sandbox_id not in {e.message for e in built.logs}  # a new identity, not the build sandbox's
    finally:
        sbx.kill()


def test_exists_and_tags(built: Built) -> None:
    assert Template.exists(built.name)
    assert not Template.exists(_name("never-built"))
    info = Template.assign_tags(f"{built.name}:default", ["v1"])
    assert info.tags == ["v1"]
    assert "v1" in {t.tag for t in Template.get_tags(built.name)}
    sbx = Sandbox.create(f"{built.name}:v1", timeout=60)
    try:
        assert sbx.commands.run("cat /home/user/one.txt").stdout == "one file\n"
    finally:
        sbx.kill()
    Template.remove_tags(built.name, ["v1"])
    assert "v1" not in {t.tag for t in Template.get_tags(built.name)}
    with pytest.raises(Exception, match="not found|404"):
        Sandbox.create(f"{built.name}:v1", timeout=60)


def _health(server: Server) -> dict[str, Any]:
    status, body = _call(server, "GET", "/health")
    assert status == 200, body
    return dict(body)


def _wait_pool(server: Server, name: str) -> None:
    """Until the template's warm pool (--template-pool-size, 1 here) holds a restored sandbox."""
    deadline = time.monotonic() + 240
    while _health(server)["pools"].get(name, 0) < 1:
        assert time.monotonic() < deadline, f"the pool of {name} was never refilled: {_health(server)}"
        time.sleep(0.2)


def test_a_create_after_the_first_is_claimed_from_the_templates_warm_pool(built: Built, server: Server) -> None:
    Sandbox.create(built.name, timeout=60).kill()  # a create starts the template's pool (if none did before)
    _wait_pool(server, built.name)
    claims = _health(server)["poolClaims"][built.name]
    sbx = Sandbox.create(built.name, timeout=60, envs={"MINE": "claimed"}, metadata={"who": "claimed"})
    try:
        assert _health(server)["poolClaims"][built.name] == claims + 1  # this create took the pooled sandbox
        r = sbx.commands.run(f'echo "$MINE|$GREETING"; cat /home/user/one.txt; pwd; whoami; '
                             f"curl -s -o /dev/null -w '%{{http_code}}\\n' http://127.0.0.1:{PORT}/")
        assert r.stdout.splitlines() == ["claimed|hello there", "one file", "/home/user/work", "user", "200"]
        identity = json.loads(sbx.commands.run("cat /run/keepstate/identity.json").stdout)
        assert identity["sandboxId"] == sbx.sandbox_id  # it knows its own identity, not a pool's
        assert sbx.get_info().metadata == {"who": "claimed"}
        assert sbx.is_running()
    finally:
        sbx.kill()


def test_concurrent_creates_past_the_pool_each_get_a_sandbox_of_their_own(built: Built, server: Server) -> None:
    # A built template's pool starts with its first create, and a rebuild retires it: under xdist this worker may
    # not have created from its build yet (a fresh-clone run waited 240 s for a pool nobody had started).
    Sandbox.create(built.name, timeout=60).kill()
    _wait_pool(server, built.name)
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        boxes = list(ex.map(lambda i: Sandbox.create(built.name, timeout=60, envs={"N": str(i)}), range(3)))
    try:
        assert len({b.sandbox_id for b in boxes}) == 3
        for i, b in enumerate(boxes):
            b.files.write("/home/user/mine.txt", f"box {i}\n")
        for i, b in enumerate(boxes):  # one claimed from the pool, two restored: none shares another's files
            assert b.commands.run('echo "$N"; cat /home/user/mine.txt').stdout == f"{i}\nbox {i}\n"
    finally:
        for b in boxes:
            b.kill()


def _messages(logs: list[Any]) -> list[str]:
    return [e.message for e in logs]


def test_a_second_build_takes_every_step_from_the_cache(built: Built) -> None:
    logs: list[Any] = []
    Template.build(_template(built.ctx), built.name, cpu_count=1, memory_mb=1024, on_build_logs=logs.append)
    messages = _messages(logs)
    cached = [m for m in messages if m.startswith("CACHED [")]
    assert len(cached) == 10, messages
    assert not any(m.startswith("[1/") or m.startswith("[5/") for m in messages), messages  # no step ran again
    first = [m for m in _messages(built.logs) if m.startswith("[5/10] RUN")]
    assert first, _messages(built.logs)  # the first build did run them
    sbx = Sandbox.create(built.name, timeout=60)
    try:
        assert sbx.commands.run("cat /tmp/root-whoami").stdout == "root\n"
    finally:
        sbx.kill()


def test_background_build_with_skip_cache_and_status_polling(built: Built) -> None:
    name = _name("bg")
    info = Template.build_in_background(_template(built.ctx), name, cpu_count=1, memory_mb=1024, skip_cache=True)
    first = Template.get_build_status(info)
    assert first.status.value in ("building", "ready")
    entries: list[Any] = []
    status = first
    deadline = time.monotonic() + 280
    while True:
        status = Template.get_build_status(info, logs_offset=len(entries))
        entries += status.log_entries
        if status.status.value in ("ready", "error") and not status.log_entries:
            break
        assert time.monotonic() < deadline, "the build did not finish"
        time.sleep(0.5)
    assert status.status.value == "ready", status.reason
    messages = _messages(entries)
    assert not any(m.startswith("CACHED") for m in messages), messages  # skip_cache: every step ran
    assert any(m.startswith("[5/10] RUN") for m in messages)


def test_a_failing_step_says_its_exit_status_and_output(e2b_env: None) -> None:
    t = Template().from_base_image().run_cmd("echo about to fail; exit 3")
    with pytest.raises(BuildException) as exc:
        Template.build(t, _name("fail"), cpu_count=1, memory_mb=1024)
    assert "failed to run command 'echo about to fail; exit 3': exit status 3" in str(exc.value)
    assert "about to fail" in str(exc.value)


def test_an_unknown_user_fails_with_e2bs_message(e2b_env: None) -> None:
    t = Template().from_base_image().run_cmd("whoami", user="root123")
    with pytest.raises(BuildException, match="failed to run command 'whoami': command failed: unauthenticated: "
                                             "invalid username: 'root123'"):
        Template.build(t, _name("baduser"), cpu_count=1, memory_mb=1024)
    assert not Template.exists(_name("baduser"))


def _call(server: Server, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    req = urllib.request.Request(server.url + path, method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"X-API-KEY": server.key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_an_upload_that_does_not_match_its_hash_is_refused(server: Server) -> None:
    status, info = _call(server, "POST", "/v3/templates", {"name": _name("mismatch")})
    assert status == 202
    files_hash = "0" * 64
    status, link = _call(server, "GET", f"/templates/{info['templateID']}/files/{files_hash}")
    assert status == 201 and link["present"] is False
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"not what was hashed\n"
        member = tarfile.TarInfo("x.txt")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    put = urllib.request.Request(link["url"], data=buf.getvalue(), method="PUT")  # no API key: the URL is signed
    with urllib.request.urlopen(put, timeout=60) as r:
        assert r.status == 201
    bad = urllib.request.Request(link["url"].replace("signature=", "signature=0"), data=b"x", method="PUT")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(bad, timeout=60)
    assert refused.value.code == 401 and "signature" in json.loads(refused.value.read())["message"]
    status, _ = _call(server, "POST", f"/v2/templates/{info['templateID']}/builds/{info['buildID']}", {
        "fromImage": "e2bdev/base", "force": False,
        "steps": [{"type": "COPY", "args": ["x.txt", "/tmp/x.txt", "", ""], "force": False, "filesHash": files_hash}]})
    assert status == 202
    path = f"/templates/{info['templateID']}/builds/{info['buildID']}/status"
    deadline = time.monotonic() + 240
    while (build := _call(server, "GET", path)[1])["status"] not in ("ready", "error"):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert build["status"] == "error"
    assert build["reason"]["step"] == "1"
    assert "does not match its filesHash" in build["reason"]["message"]
    # and the bad upload is gone: the files check asks for it again
    status, link = _call(server, "GET", f"/templates/{info['templateID']}/files/{files_hash}")
    assert status == 201 and link["present"] is False


def test_bad_build_bodies_are_clear_json_errors(server: Server) -> None:
    status, info = _call(server, "POST", "/v3/templates", {"name": _name("bad")})
    status, err = _call(server, "POST", f"/v2/templates/{info['templateID']}/builds/{info['buildID']}",
                        {"steps": [{"type": "FROB", "args": []}]})
    assert status == 400 and "step 1" in err["message"]
    status, err = _call(server, "POST", "/v3/templates", {"name": "base"})
    assert status == 409 and "base" in err["message"]


def test_the_cli_builds_a_dockerfile_on_a_built_template(built: Built, server: Server, tmp_path: Path) -> None:
    (tmp_path / "app.txt").write_text("from the dockerfile\n")
    (tmp_path / "Dockerfile").write_text(f"FROM {built.name}\nCOPY app.txt /home/user/app.txt\n"
                                         "RUN cat /home/user/app.txt > /home/user/copied\nENV MODE=docker\n")
    name = _name("docker")
    env = {**os.environ, "E2B_API_URL": server.url, "E2B_API_KEY": server.key}
    out = subprocess.run([str(KEEPSTATE), "template", "build", "--dockerfile", str(tmp_path / "Dockerfile"),
                          "--name", name, "--context", str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=280)
    assert out.returncode == 0, out.stderr + out.stdout
    assert "[2/3] RUN" in out.stdout and "ready" in out.stderr
    sbx = Sandbox.create(name, timeout=60)
    try:
        r = sbx.commands.run('cat /home/user/copied /home/user/one.txt; echo "$MODE $GREETING"')
        assert r.stdout.splitlines() == ["from the dockerfile", "one file", "docker hello there"]
    finally:
        sbx.kill()
    bad = tmp_path / "Multi"
    bad.write_text("FROM base AS one\nRUN true\nFROM base\n")
    out = subprocess.run([str(KEEPSTATE), "template", "build", "--dockerfile", str(bad), "--name", _name("multi")],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "multi-stage" in out.stderr


def test_the_code_interpreters_sdk_runs_code_in_a_template_built_on_it(e2b_env: None) -> None:
    ci = pytest.importorskip("e2b_code_interpreter")
    name = _name("ci")
    t = Template().from_template("code-interpreter-v1").run_cmd("echo 41 > /home/user/n")
    Template.build(t, name)
    sbx = ci.Sandbox.create(name, timeout=120)
    try:
        execution = sbx.run_code("print(int(open('/home/user/n').read()) + 1)")
        assert execution.error is None, execution.error
        assert execution.logs.stdout == ["42\n"]
    finally:
        sbx.kill()
