"""The agent's wire surface without the SDK: access token, /init, JSON errors, raw Connect framing."""

from __future__ import annotations

import base64
import gzip
import json
import secrets
import struct
import time

import pytest

from tests.agent.harness import HOST_ONLY_REASON, REMOTE

UNAUTHORIZED = {
    "code": 401,
    "message": "unauthorized access, please provide a valid access token or method signing if supported",
}
host_only = pytest.mark.skipif(REMOTE, reason=HOST_ONLY_REASON)


def _frames(body: bytes) -> list[tuple[int, dict]]:
    out, i = [], 0
    while i < len(body):
        flags, length = struct.unpack(">BI", body[i : i + 5])
        out.append((flags, json.loads(body[i + 5 : i + 5 + length])))
        i += 5 + length
    return out


def _envelope(message: dict) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(data)) + data


class _Stream:
    """The frames of a streaming Connect response, read as they arrive: to wait for one, not for a guessed time."""

    def __init__(self, response) -> None:  # an httpx.Response, streaming
        self._chunks = response.iter_raw()
        self._buffer = b""
        self.frames: list[tuple[int, dict]] = []

    def _next(self) -> tuple[int, dict] | None:
        while True:
            if len(self._buffer) >= 5:
                flags, length = struct.unpack(">BI", self._buffer[:5])
                if len(self._buffer) >= 5 + length:
                    frame = (flags, json.loads(self._buffer[5 : 5 + length]))
                    self._buffer = self._buffer[5 + length :]
                    self.frames.append(frame)
                    return frame
            chunk = next(self._chunks, None)
            if chunk is None:
                assert not self._buffer, f"the stream ended inside a frame: {self._buffer!r}"
                return None
            self._buffer += chunk

    def until(self, what: str, event: str, within_s: float = 20.0) -> None:
        """Read on until a message frame whose event is `event` ("start", "keepalive", ...)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            frame = self._next()
            if frame is None:
                raise AssertionError(f"the stream ended before {what}: {self.frames}")
            if frame[0] == 0 and event in frame[1].get("event", {}):
                return
        raise AssertionError(f"no {what} within {within_s:g} s: {self.frames}")

    def rest(self) -> list[tuple[int, dict]]:
        while self._next() is not None:
            pass
        return self.frames


def test_health_needs_no_token(secured) -> None:
    http = secured.client()
    r = http.get("/health")
    assert r.status_code == 204


def test_token_required_everywhere_else(secured) -> None:
    token, http = secured.token, secured.client()
    for method, path in [("GET", "/envs"), ("GET", "/metrics"), ("POST", "/process.Process/List"),
                         ("POST", "/filesystem.Filesystem/Stat")] + ([] if REMOTE else [("POST", "/init")]):
        r = http.request(method, path, headers={"Content-Type": "application/json"}, content=b"{}")
        assert (r.status_code, r.json()) == (401, UNAUTHORIZED), path
        r = http.request(method, path, headers={"X-Access-Token": "wrong"}, content=b"{}")
        assert r.status_code == 401, path
    r = http.get("/envs", headers={"X-Access-Token": token})
    assert r.status_code == 200
    assert r.json()["SECURED"] == "1"


@host_only
def test_sdk_with_wrong_token_is_refused(control_plane, agent) -> None:
    from e2b import AuthenticationException, Sandbox

    sbx = Sandbox.create()
    agent.init(secrets.token_hex(8))  # the host re-keys the sandbox: the old token stops working
    with pytest.raises(AuthenticationException):
        sbx.commands.run("true")
    with pytest.raises(AuthenticationException):
        sbx.files.list("/")


@host_only
def test_init_rekey_requires_current_token(secured, agent) -> None:
    token, http = secured.token, secured.client()
    r = http.post("/init", json={"accessToken": "stolen"})
    assert r.status_code == 401
    new = secrets.token_hex(8)
    r = http.post("/init", json={"accessToken": new, "envVars": {"A": "b"}},
                   headers={"X-Access-Token": token})
    assert r.status_code == 204
    agent.token = new
    assert http.get("/envs", headers={"X-Access-Token": token}).status_code == 401
    assert http.get("/envs", headers={"X-Access-Token": new}).json()["A"] == "b"
    r = http.post("/init", content=b"not json", headers={"X-Access-Token": new})
    assert r.status_code == 400 and r.json()["code"] == 400


def test_metrics_shape(secured) -> None:
    token, http = secured.token, secured.client()
    body = http.get("/metrics", headers={"X-Access-Token": token}).json()
    for key in ("ts", "cpu_count", "cpu_used_pct", "mem_total", "mem_used", "disk_used", "disk_total"):
        assert isinstance(body[key], (int, float)), key
    assert body["mem_total"] > 0


def test_files_errors_are_json(secured, home_dir) -> None:
    token, http = secured.token, secured.client()
    h = {"X-Access-Token": token}
    r = http.get("/files", params={"path": home_dir + "/nope"})
    assert (r.status_code, r.json()) == (401, UNAUTHORIZED)
    r = http.get("/files", params={"path": home_dir + "/nope"}, headers=h)
    assert r.status_code == 404
    assert r.json() == {"code": 404, "message": f"path '{home_dir}/nope' does not exist"}
    r = http.get("/files", params={"path": "x", "username": "no-such-user"}, headers=h)
    assert r.status_code == 401 and "invalid username" in r.json()["message"]
    r = http.get("/files", params={"path": "a\x00b"}, headers=h)
    assert r.status_code == 400 and r.json()["code"] == 400
    r = http.get("/files", params={"path": "/"}, headers=h)
    assert r.status_code == 400 and "directory" in r.json()["message"]
    r = http.post("/files", content=b"x", headers={**h, "Content-Type": "application/octet-stream"})
    assert r.status_code == 400 and "path" in r.json()["message"]
    r = http.post("/files", params={"path": home_dir + "/g"}, content=b"not gzip",
                   headers={**h, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
    assert r.status_code == 400 and "gzip" in r.json()["message"]
    r = http.post("/files", params={"path": "/tmp"}, content=b"x",
                   headers={**h, "Content-Type": "application/octet-stream"})
    assert r.status_code == 400 and "directory" in r.json()["message"]
    r = http.post("/files", params={"path": home_dir + "/t"}, content=b"x",
                   headers={**h, "Content-Type": "text/plain"})
    assert r.status_code == 400
    r = http.post("/files", params={"path": home_dir + "/m"}, content=b"x",
                   headers={**h, "Content-Type": "application/octet-stream", "X-Metadata-Bad": "caf\u00e9".encode()})
    assert r.status_code == 400 and "metadata" in r.json()["message"]
    r = http.get("/nowhere", headers=h)
    assert r.status_code == 404 and r.json()["code"] == 404


def test_files_path_traversal_resolves_cleanly(secured, home_dir) -> None:
    token, http = secured.token, secured.client()
    name = home_dir.rsplit("/", 1)[1]
    sneaky = f"../../home/user/{name}/../{name}/./t.txt"
    r = http.post("/files", files={"file": (sneaky, b"ok")}, headers={"X-Access-Token": token})
    assert r.status_code == 200, r.text
    assert r.json() == [{"path": f"{home_dir}/t.txt", "name": "t.txt", "type": "file"}]
    r = http.get("/files", params={"path": f"{home_dir}/t.txt"},
                  headers={"X-Access-Token": token, "Accept-Encoding": "gzip"})
    assert r.headers.get("content-encoding") == "gzip" and r.content == b"ok"


def test_octet_stream_gzip_upload(secured, home_dir) -> None:
    token, http = secured.token, secured.client()
    payload = b"z" * 100_000
    r = http.post("/files", params={"path": f"{home_dir}/z.bin"}, content=gzip.compress(payload),
                   headers={"X-Access-Token": token, "Content-Type": "application/octet-stream",
                            "Content-Encoding": "gzip", "X-Metadata-Stage": "raw"})
    assert r.status_code == 200, r.text
    assert r.json() == [{"path": f"{home_dir}/z.bin", "name": "z.bin", "type": "file", "metadata": {"stage": "raw"}}]
    r = http.get("/files", params={"path": f"{home_dir}/z.bin"},
                  headers={"X-Access-Token": token, "Accept-Encoding": "identity"})
    assert r.content == payload and r.headers["content-length"] == str(len(payload))


def test_raw_connect_stream_tags_and_keepalive(secured, home_dir) -> None:
    token = secured.token
    headers = {"X-Access-Token": token, "Content-Type": "application/connect+json",
               "Connect-Protocol-Version": "1", "Keepalive-Ping-Interval": "1",
               "Authorization": "Basic " + base64.b64encode(b"root:").decode()}
    # The process says nothing until the test releases it (or 30 s pass): it is still running when listed, and its
    # stream stays silent until a keepalive has come.
    release = f"{home_dir}/release"
    script = 'for _ in $(seq 600); do [ -e "$1" ] && break; sleep 0.05; done; echo tagged'
    start = {"process": {"cmd": "/bin/sh", "args": ["-c", script, "sh", release]}, "tag": "job-1", "stdin": False}
    unary = {"X-Access-Token": token, "Content-Type": "application/json"}
    with secured.client() as client:
        with client.stream("POST", "/process.Process/Start", content=_envelope(start), headers=headers) as r:
            assert r.status_code == 200
            assert r.headers["content-type"] == "application/connect+json"
            stream = _Stream(r)
            stream.until("the start event", "start")
            listed = client.post("/process.Process/List", json={}, headers=unary).json()
            tagged = [p for p in listed["processes"] if p.get("tag") == "job-1"]
            assert len(tagged) == 1
            stream.until("a keepalive", "keepalive")
            up = client.post("/files", params={"path": release}, content=b"go",
                             headers={"X-Access-Token": token, "Content-Type": "application/octet-stream"})
            assert up.status_code == 200, up.text
            frames = stream.rest()
    events = [f[1] for f in frames if f[0] == 0]
    assert events[0]["event"]["start"]["pid"] == tagged[0]["pid"]
    assert any("keepalive" in e["event"] for e in events)
    stdout = b"".join(base64.b64decode(e["event"]["data"]["stdout"]) for e in events if "data" in e["event"])
    assert stdout == b"tagged\n"
    end = events[-1]["event"]["end"]
    assert (end.get("exitCode", 0), end["exited"], end["status"]) == (0, True, "exit status 0")  # proto3 omits 0
    assert frames[-1] == (2, {})


def test_raw_connect_by_tag_and_sigterm(secured) -> None:
    token = secured.token
    unary = {"X-Access-Token": token, "Content-Type": "application/json"}
    headers = {"X-Access-Token": token, "Content-Type": "application/connect+json"}
    start = {"process": {"cmd": "/bin/sleep", "args": ["30"]}, "tag": "sleepy"}
    with secured.client() as client:
        with client.stream("POST", "/process.Process/Start", content=_envelope(start), headers=headers) as r:
            stream = _Stream(r)
            stream.until("the start event", "start")  # the tag is known from here on
            sig = {"process": {"tag": "sleepy"}, "signal": "SIGNAL_SIGTERM"}
            assert client.post("/process.Process/SendSignal", json=sig, headers=unary).status_code == 200
            frames = stream.rest()
        end = frames[-2][1]["event"]["end"]
        assert end["status"] == "signal: terminated" and end["exitCode"] == -1
        bad = client.post("/process.Process/SendSignal",
                          json={"process": {"pid": 1}, "signal": "SIGNAL_UNSPECIFIED"}, headers=unary)
        assert bad.status_code in (404, 501)
        missing = client.post("/process.Process/SendInput",
                              json={"process": {"tag": "never"}, "input": {"stdin": "eA=="}}, headers=unary)
        assert missing.status_code == 404 and missing.json()["code"] == "not_found"


def _deadline_error(frames: list[tuple[int, dict]]) -> dict:
    """The error of a stream ended by its deadline, after checking that no end event came before it."""
    assert not [f for f in frames if f[0] == 0 and "end" in f[1]["event"]], frames
    flags, last = frames[-1]
    assert flags == 2 and "error" in last, frames
    return last["error"]


def test_raw_start_deadline_ends_stream_and_process(secured) -> None:
    # As a Connect deadline does (envd's): the stream ends with deadline_exceeded, and not with the end event of
    # the process, which envd kills when the Start request's deadline passes.
    headers = {"X-Access-Token": secured.token, "Content-Type": "application/connect+json",
               "Connect-Timeout-Ms": "1000"}
    start = {"process": {"cmd": "/bin/sleep", "args": ["30"]}, "stdin": False}
    with secured.client() as client:
        with client.stream("POST", "/process.Process/Start", content=_envelope(start), headers=headers) as r:
            assert r.status_code == 200
            stream = _Stream(r)
            stream.until("the start event", "start")
            frames = stream.rest()
        assert _deadline_error(frames)["code"] == "deadline_exceeded"
        pid = frames[0][1]["event"]["start"]["pid"]
        # A stream without a deadline of its own sees the end of the kill.
        connect = {"process": {"pid": pid}}
        no_deadline = {k: v for k, v in headers.items() if k != "Connect-Timeout-Ms"}
        with client.stream("POST", "/process.Process/Connect", content=_envelope(connect), headers=no_deadline) as r:
            frames = _Stream(r).rest()
    end = frames[-2][1]["event"]["end"]
    assert (end["status"], end["exitCode"]) == ("signal: killed", -1)
    assert frames[-1] == (2, {})


def test_raw_connect_deadline_ends_only_the_stream(secured) -> None:
    headers = {"X-Access-Token": secured.token, "Content-Type": "application/connect+json"}
    unary = {"X-Access-Token": secured.token, "Content-Type": "application/json"}
    start = {"process": {"cmd": "/bin/sleep", "args": ["30"]}, "stdin": False}
    with secured.client() as client:
        with client.stream("POST", "/process.Process/Start", content=_envelope(start), headers=headers) as r:
            stream = _Stream(r)
            stream.until("the start event", "start")
            pid = stream.frames[0][1]["event"]["start"]["pid"]
            connect = {"process": {"pid": pid}}
            with client.stream("POST", "/process.Process/Connect", content=_envelope(connect),
                               headers={**headers, "Connect-Timeout-Ms": "500"}) as attached:
                frames = _Stream(attached).rest()
            assert _deadline_error(frames)["code"] == "deadline_exceeded"
            # The process runs on: the deadline was the Connect stream's, not the process's.
            listed = client.post("/process.Process/List", json={}, headers=unary).json()
            assert pid in [p["pid"] for p in listed["processes"]]
            kill = {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}
            assert client.post("/process.Process/SendSignal", json=kill, headers=unary).status_code == 200
            frames = stream.rest()
    assert frames[-2][1]["event"]["end"]["status"] == "signal: killed"


def test_unknown_user_and_bad_query(secured) -> None:
    token, http = secured.token, secured.client()
    headers = {"X-Access-Token": token, "Content-Type": "application/json",
               "Authorization": "Basic " + base64.b64encode(b"ghost:").decode()}
    r = http.post("/filesystem.Filesystem/Stat", json={"path": "/"}, headers=headers)
    assert r.status_code == 401
    assert r.json() == {"code": "unauthenticated", "message": "invalid username: 'ghost'"}
    r = http.get("/files?path=%ff%fe", headers={"X-Access-Token": token})
    assert r.status_code == 400 and r.json()["code"] == 400


def test_missing_program_is_an_error_for_every_user(secured) -> None:
    headers = {"X-Access-Token": secured.token, "Content-Type": "application/connect+json"}
    with secured.client() as client:
        for user in (b"user:", b"root:"):
            auth = {"Authorization": "Basic " + base64.b64encode(user).decode()}
            for cmd in ("no-such-program", "/no/such/program"):
                start = {"process": {"cmd": cmd, "args": []}, "stdin": False}
                r = client.post("/process.Process/Start", content=_envelope(start), headers={**headers, **auth})
                frames = _frames(r.content) if r.status_code == 200 else [(2, r.json())]
                flags, last = frames[-1]
                assert flags == 2 and last["error"]["code"] == "internal", (user, cmd, frames)
                assert f"error starting process '{cmd}'" in last["error"]["message"]
