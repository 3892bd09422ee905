"""A fake sandbox runtime, in-process: the `Runtime` seam without gVisor, for lifecycle tests that run in
milliseconds (`keepstate serve --runtime fake` serves with it).

Each instance is a small HTTP server on a loopback address of its own (127.N.x.y, the agent's port; each
FakeRuntime claims a 127.N.0.0/16 of its own) that acts like the agent where the lifecycle touches it:
`/health`, `/init` (token rules included), `/metrics`, `/journal`, and `/files` (read and write: the stock SDK's
`files.read` and `files.write` work). Its state (files, journal, token, environment) is what a checkpoint writes
and a restore reads back, so a paused or forked fake sandbox comes back with its files.

It keeps gVisor's hazards, so tests catch code that breaks the rules real sandboxes impose:
- a **frozen** instance answers nothing until thawed (requests hang, as into a frozen sandbox), whether `freeze`
  (a pause's) or `idle_freeze` (an idle sandbox's cgroup freezer, docs/design/idle.md) froze it;
- a **checkpoint taken while a connection is open** into the instance is recorded in `violations`, and an
  instance restored from that image is **wedged** (answers nothing), as gVisor 20240729's restored agent is.

Faults are injected with `fail(op, times)` (the next calls of `op` raise RuntimeFailure; a failed destroy leaves
the instance), slowed with `delay[op] = seconds`, and held with `gates[op]` (a threading.Event every call of `op`
waits for), all deterministic. `inventory(home)` and `remains(handle)` report what is left as gVisor's do: an
instance not destroyed is a "container", a slot recorded for the data directory a "slot".
"""

from __future__ import annotations

import base64
import fcntl
import io
import json
import os
import socketserver
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from keepstate.ports import AGENT_PORT
from keepstate.runtime.base import Endpoint, Handle, Leftover, Limits, RuntimeFailure, SandboxSpec

STATE_FILE = "fake-state.json"
MEMORY_FILE = "pages.img"  # a stand-in for gVisor's memory file, so the store has bytes to chunk


NETS = range(64, 250)  # 127.N.0.0/16 for N in NETS: one per FakeRuntime on the host
_NET_LOCKS = Path(tempfile.gettempdir()) / "keepstate-fake-nets"


def _claim_net() -> tuple[int, int]:
    """A loopback /16 of this runtime's own, held (flock) for the process's life: FakeRuntimes in other test
    processes never listen on the same addresses."""
    _NET_LOCKS.mkdir(exist_ok=True)
    for net in NETS:
        fd = os.open(_NET_LOCKS / f"{net}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return net, fd
        except BlockingIOError:
            os.close(fd)
    raise RuntimeFailure("fake runtime: every loopback network is held by another FakeRuntime")


class FakeSlots:
    """An in-memory slot table (one per FakeRuntime)."""

    max_slots = 4096

    def __init__(self) -> None:
        self._owners: dict[int, str | None] = {}
        self._homes: dict[int, str] = {}
        self._lock = threading.Lock()

    def claim(self, slot: int) -> bool:
        with self._lock:
            if slot in self._owners:
                return False
            self._owners[slot] = None
            return True

    def record_owner(self, slot: int, home: str, name: str) -> None:
        with self._lock:
            self._owners[slot] = name
            self._homes[slot] = home

    def owner(self, slot: int) -> str | None:
        with self._lock:
            return self._owners.get(slot)

    def release(self, slot: int) -> None:
        with self._lock:
            self._owners.pop(slot, None)
            self._homes.pop(slot, None)

    def orphaned(self) -> list[tuple[int, str]]:
        with self._lock:
            return [(slot, name) for slot, name in self._owners.items()
                    if name and not Path(self._homes[slot]).is_dir()]

    def home(self, slot: int) -> str | None:
        with self._lock:
            return self._homes.get(slot)

    def owned(self, home: str) -> list[tuple[int, str]]:
        with self._lock:
            return [(slot, name) for slot, name in self._owners.items() if name and self._homes.get(slot) == home]

    def held(self, slot: int) -> bool:
        with self._lock:
            return slot in self._owners


@dataclass
class AgentState:
    token: str = ""
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    journal: list[dict[str, Any]] = field(default_factory=list)
    boots: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"token": self.token, "env": self.env, "journal": self.journal, "boots": self.boots,
                "files": {p: base64.b64encode(b).decode() for p, b in self.files.items()}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AgentState:
        return cls(token=d["token"], env=dict(d["env"]), journal=list(d["journal"]), boots=int(d["boots"]) + 1,
                   files={p: base64.b64decode(b) for p, b in d["files"].items()})

    def note(self, kind: str, data: dict[str, Any]) -> None:
        self.journal.append({"seq": len(self.journal) + 1, "ts": time.time(), "kind": kind, "data": data})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: str, agent: FakeAgent) -> None:
        self.agent = agent
        self.connections = 0
        self._count = threading.Lock()
        super().__init__((address, AGENT_PORT), _Handler)

    def server_bind(self) -> None:
        # http.server's own asks socket.getfqdn() for the address: a reverse DNS query of 127.N.x.y to the host's
        # resolver, which inside the tests' isolated namespace nobody answers (5-10 s per instance start).
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away (a cut connection) is normal here; real agents say nothing either

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._count:
            self.connections += 1
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._count:
            self.connections -= 1
        super().shutdown_request(request)


def files_tar(files: dict[str, bytes]) -> bytes:
    """The fake's files as the real agent's export sends them: a tar, paths relative to the root."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, data in sorted(files.items()):
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def tar_files(data: bytes) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        for m in tar.getmembers():
            f = tar.extractfile(m)
            if f is not None:
                files["/" + m.name] = f.read()
    return files


class FakeAgent:
    """One fake instance's agent."""

    def __init__(self, address: str, state: AgentState, wedged: bool = False) -> None:
        self.state = state
        self.wedged = wedged
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.running.set()
        self.awake = threading.Event()  # cleared while idle_freeze holds the instance
        self.awake.set()
        self.busy = False  # tests: a command "runs" (GET /keepstate/idle answers not idle)
        self.idle_looks = 0  # how many times the host asked /keepstate/idle
        self.dead = threading.Event()
        self.server = _Server(address, self)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       name=f"fake-agent-{address}", daemon=True)
        self.thread.start()

    def open_connections(self) -> int:
        return self.server.connections

    def stop(self) -> None:
        self.dead.set()
        self.running.set()
        self.awake.set()
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes = b"", ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        if body:
            self.send_header("Content-Type", ctype)
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _json(self, status: int, value: Any) -> None:
        self._send(status, json.dumps(value).encode())

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":  # a streamed upload (apply_files)
            out = bytearray()
            while (size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)) > 0:
                out += self.rfile.read(size)
                self.rfile.readline()  # the CRLF after the chunk
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers, then the blank line
                pass
            return bytes(out)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _gate(self) -> bool:
        agent = self.server.agent
        if agent.wedged:
            agent.dead.wait()
            return False
        agent.running.wait()
        agent.awake.wait()
        return not agent.dead.is_set()

    def _authorised(self) -> bool:
        token = self.server.agent.state.token
        if token and self.headers.get("X-Access-Token") != token:
            self._json(401, {"code": 401, "message": "unauthorized access, please provide a valid access token"})
            return False
        return True

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if not self._gate():
            return
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        agent = self.server.agent
        if url.path == "/health":
            return self._send(204)
        if not self._authorised():
            return
        with agent.lock:
            st = agent.state
            if url.path == "/metrics":
                return self._json(200, {"disk_used": sum(map(len, st.files.values())), "disk_total": 1 << 30})
            if url.path == "/journal":
                after, limit = int(query.get("after", 0)), int(query.get("limit", 500))
                events = [e for e in st.journal if e["seq"] > after][:limit]
                return self._json(200, {"events": events, "next": events[-1]["seq"] if events else after,
                                        "oldest": 1 if st.journal else None, "last": len(st.journal)})
            if url.path == "/files":
                data = st.files.get(query.get("path", ""))
                if data is None:
                    return self._json(404, {"code": 404, "message": f"path '{query.get('path')}' does not exist"})
                return self._send(200, data, "application/octet-stream")
            if url.path == "/keepstate/idle":  # the real agent also looks at processes and their CPU time
                agent.idle_looks += 1
                return self._json(200, {"idle": not agent.busy, "last": len(st.journal),
                                        "why": "a command runs" if agent.busy else ""})
            if url.path == "/keepstate/files":  # a filesystem-only pause: the fake's files, as a tar
                return self._send(200, files_tar(st.files), "application/x-tar")
        self._json(404, {"code": 404, "message": f"no such path {url.path}"})

    def do_PUT(self) -> None:  # noqa: N802
        if not self._gate():
            return
        agent = self.server.agent
        body = self._body()
        if urlsplit(self.path).path == "/keepstate/files" and self._authorised():
            files = tar_files(body)
            with agent.lock:
                agent.state.files.update(files)
            return self._json(200, {"entries": len(files)})
        self._json(404, {"code": 404, "message": f"no such path {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        if not self._gate():
            return
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        agent = self.server.agent
        body = self._body()
        if url.path == "/init":
            if not self._authorised():
                return
            doc = json.loads(body or b"{}")
            with agent.lock:
                agent.state.token = str(doc.get("accessToken") or agent.state.token)
                agent.state.env = dict(doc.get("envVars") or {})
                agent.state.note("init", {"sandbox_id": doc.get("sandboxId")})
            return self._send(204)
        if url.path == "/files":
            if not self._authorised():
                return
            path = query.get("path", "")
            data = _multipart_file(body, self.headers.get("Content-Type", ""))
            with agent.lock:
                agent.state.files[path] = data
                agent.state.note("file.write", {"path": path, "size": len(data)})
            return self._json(200, [{"name": path.rsplit("/", 1)[-1], "type": "file", "path": path}])
        self._json(404, {"code": 404, "message": f"no such path {url.path}"})


def _multipart_file(body: bytes, ctype: str) -> bytes:
    """The first part of a multipart/form-data body (what the SDK's files.write sends), else the body itself."""
    if "multipart/form-data" not in ctype or "boundary=" not in ctype:
        return body
    boundary = ctype.split("boundary=", 1)[1].split(";")[0].strip().strip('"').encode()
    parts = body.split(b"--" + boundary)
    for part in parts[1:]:
        if part.startswith(b"--"):
            break
        head, _, content = part.partition(b"\r\n\r\n")
        if head:
            return content[:-2] if content.endswith(b"\r\n") else content
    return b""


@dataclass
class _Instance:
    spec: SandboxSpec
    slot: int
    agent: FakeAgent
    status: str = "running"
    home: str | None = None  # the data directory its slot was recorded for when it started


class FakeRuntime:
    kind = "fake"
    release = "fake-1"

    def __init__(self) -> None:
        self.net, self._net_fd = _claim_net()
        self.slots = FakeSlots()
        self.violations: list[str] = []  # checkpoints taken with a connection open (gVisor would wedge)
        self.delay: dict[str, float] = {}  # op -> seconds each call of it takes (widens race windows)
        self.gates: dict[str, threading.Event] = {}  # op -> every call of it waits until this is set
        self.calls: dict[str, int] = {}
        self._faults: dict[str, int] = {}
        self._instances: dict[str, _Instance] = {}
        self._lock = threading.Lock()

    # -- test controls ------------------------------------------------------------------------------------------
    def fail(self, op: str, times: int = 1) -> None:
        """The next `times` calls of `op` ("create", "checkpoint", "freeze", "thaw", "restore", "destroy") fail."""
        self._faults[op] = self._faults.get(op, 0) + times

    def heal(self, op: str) -> None:
        """Calls of `op` succeed again (faults still pending from fail() are dropped)."""
        self._faults.pop(op, None)

    def crash(self, name: str) -> None:
        """The instance dies (as a sandbox OOM-killed or crashed): gone, its agent with it."""
        with self._lock:
            inst = self._instances.pop(name, None)
        if inst is not None:
            inst.agent.stop()

    def agent(self, name: str) -> FakeAgent:
        return self._instances[name].agent

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._instances)

    def _op(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        gate = self.gates.get(op)
        if gate is not None:
            gate.wait()
        if self.delay.get(op):
            time.sleep(self.delay[op])
        if self._faults.get(op):
            self._faults[op] -= 1
            raise RuntimeFailure(f"fake runtime: injected failure of {op}")

    def _get(self, name: str) -> _Instance:
        with self._lock:
            inst = self._instances.get(name)
        if inst is None:
            raise RuntimeFailure(f"fake runtime: no instance {name!r}")
        return inst

    def address_of(self, slot: int) -> str:
        return f"127.{self.net}.{slot // 256}.{slot % 256}"

    def _handle(self, inst: _Instance) -> Handle:
        return Handle(inst.spec.name, inst.slot, Endpoint(self.address_of(inst.slot), AGENT_PORT))

    def _start(self, spec: SandboxSpec, slot: int, state: AgentState, wedged: bool = False) -> Handle:
        for m in spec.mounts:  # as runsc: a bind mount's source must be a directory
            if not m.source.is_dir():
                raise RuntimeFailure(f"fake runtime: mount source {m.source} of {m.destination} is not a directory")
        with self._lock:
            if spec.name in self._instances:
                raise RuntimeFailure(f"fake runtime: instance {spec.name} exists")
        try:
            agent = FakeAgent(self.address_of(slot), state, wedged)
        except OSError as exc:
            raise RuntimeFailure(f"fake runtime: cannot listen on {self.address_of(slot)}: {exc}") from exc
        inst = _Instance(spec, slot, agent, home=self.slots.home(slot))
        with self._lock:
            self._instances[spec.name] = inst
        return self._handle(inst)

    # -- Runtime --------------------------------------------------------------------------------------------------
    def prepare(self, open_ports: tuple[int, ...] = ()) -> None:
        pass

    def create(self, spec: SandboxSpec, slot: int) -> Handle:
        self._op("create")
        return self._start(spec, slot, AgentState())

    def state(self, name: str) -> str:
        with self._lock:
            inst = self._instances.get(name)
        return inst.status if inst is not None else "gone"

    def is_alive(self, handle: Handle) -> bool:
        return self.state(handle.name) in ("running", "paused", "unknown")

    def checkpoint(self, handle: Handle, image_dir: Path, leave_running: bool = True) -> None:
        self._op("checkpoint")
        inst = self._get(handle.name)
        inst.agent.awake.set()  # as GVisorRuntime: checkpoint, freeze, thaw and destroy undo an idle freeze first
        open_now = inst.agent.open_connections()
        if open_now:
            self.violations.append(f"checkpoint of {handle.name} with {open_now} connection(s) open")
        image_dir.mkdir(parents=True, exist_ok=True)
        with inst.agent.lock:
            doc = inst.agent.state.to_json()
        doc["wedged"] = bool(open_now)
        (image_dir / STATE_FILE).write_text(json.dumps(doc))
        # Deterministic "memory": the files' bytes padded to whole 4 KiB pages, so forks share chunks.
        blob = b"".join(inst.agent.state.files.values()) or b"\0"
        (image_dir / MEMORY_FILE).write_bytes(blob + b"\0" * (-len(blob) % 4096))
        if not leave_running:
            self.destroy(handle)

    def export_files(self, handle: Handle, dest: Path) -> int:
        """The fake's files as its agent's own export writes them, whether or not the agent answers (a wedged or
        stopped one too); refused when frozen, as runsc exec is."""
        self._op("export_files")
        inst = self._get(handle.name)
        if inst.status != "running":
            raise RuntimeFailure(f"fake runtime: {handle.name} is {inst.status}: no export")
        with inst.agent.lock:
            data = files_tar(inst.agent.state.files)
        dest.write_bytes(data)
        return len(data)

    def freeze(self, handle: Handle) -> None:
        self._op("freeze")
        inst = self._get(handle.name)
        inst.agent.awake.set()
        inst.agent.running.clear()
        inst.status = "paused"

    def thaw(self, handle: Handle) -> None:
        self._op("thaw")
        inst = self._get(handle.name)
        inst.agent.awake.set()
        inst.status = "running"
        inst.agent.running.set()

    def idle_freeze(self, handle: Handle) -> None:
        self._op("idle_freeze")
        self._get(handle.name).agent.awake.clear()

    def idle_thaw(self, handle: Handle) -> None:
        self.calls["idle_thaw"] = self.calls.get("idle_thaw", 0) + 1
        with self._lock:
            inst = self._instances.get(handle.name)
        if inst is not None:
            inst.agent.awake.set()

    def idle_frozen(self, handle: Handle) -> bool:
        with self._lock:
            inst = self._instances.get(handle.name)
        return inst is not None and not inst.agent.awake.is_set()

    def restore(self, spec: SandboxSpec, image_dir: Path, slot: int) -> Handle:
        self._op("restore")
        try:
            doc = json.loads((image_dir / STATE_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise RuntimeFailure(f"fake runtime: no image in {image_dir}: {exc}") from exc
        return self._start(spec, slot, AgentState.from_json(doc), wedged=bool(doc.get("wedged")))

    def destroy(self, handle: Handle) -> None:
        self._op("destroy")
        with self._lock:
            inst = self._instances.pop(handle.name, None)
        if inst is not None:
            inst.agent.stop()

    def remains(self, handle: Handle) -> list[Leftover]:
        with self._lock:
            return [Leftover("container", handle.name, "fake")] if handle.name in self._instances else []

    def inventory(self, home: Path) -> list[Leftover]:
        """Instances started in a slot of `home` (or in one recorded for nobody), and the slots recorded for it."""
        with self._lock:
            out = [Leftover("container", name, "fake") for name, inst in sorted(self._instances.items())
                   if inst.home in (None, str(home))]
        return out + [Leftover("slot", name, f"fake slot {slot}") for slot, name in self.slots.owned(str(home))]

    def cgroup_stats(self, handle: Handle) -> dict[str, int]:
        with self._lock:
            inst = self._instances.get(handle.name)
        if inst is None:
            return {}
        limits: Limits = inst.spec.limits
        return {"cpu_ns": int(time.monotonic() * 1e6), "mem_used": 24 << 20, "mem_cache": 0,
                "mem_limit": limits.memory_mb << 20}

    def statuses(self) -> dict[str, str]:
        with self._lock:
            return {name: inst.status for name, inst in self._instances.items()}

    def close(self) -> None:
        """Stop every instance and give up the loopback network (end of a test)."""
        for name in self.names():
            self.crash(name)
        if self._net_fd >= 0:
            os.close(self._net_fd)
            self._net_fd = -1


class FakeTemplates:
    """Templates for the fake runtime: every name given is 'built' (no root filesystem is needed)."""

    def __init__(self, names: tuple[str, ...] = ("base", "code-interpreter-v1"), root: Path | None = None) -> None:
        from keepstate.template.builder import Built
        from keepstate.template.definition import Defaults

        self.root = root or Path("/nonexistent-fake-rootfs")
        self._built = {n: Built(name=n, definition_digest=f"fake-{n}", digest=f"sha256:fake-{n}", rootfs=self.root,
                                defaults=Defaults(), built_at=0.0) for n in names}

    def names(self) -> list[str]:
        return sorted(self._built)

    def latest(self, name: str) -> Any:
        from keepstate.errors import NotFound

        if name not in self._built:
            raise NotFound(f"template '{name}' not found")
        return self._built[name]

    def find_by_digest(self, name: str, digest: str) -> Any:
        b = self._built.get(name)
        return b if b is not None and b.digest == digest else None

    def ensure_built(self, name: str) -> Any:
        return self.latest(name)

    def service_ports(self, name: str) -> list[int]:
        return []

    def service_names(self, name: str) -> dict[int, str]:
        return {}
