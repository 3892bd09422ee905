"""Start and reach KeepState servers for the SDK tests (no keepstate imports: runs in any SDK venv)."""

from __future__ import annotations

import inspect
import json
import os
import secrets
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[2]
KEEPSTATE = REPO / ".venv" / "bin" / "keepstate"
TEMPLATE_CACHE = "/var/lib/keepstate/templates"
AGENT_PORT = 49983  # E2B's envd port (keepstate.ports.AGENT_PORT), spelled out: no keepstate imports here

T = TypeVar("T")
# The shared server reached by its domain only (scripts/test.sh's E2B_DOMAIN pass): `api.<domain>` and
# `<port>-<id>.<domain>` over HTTPS, resolved by keepstate.testing.domain_dns, its CA in SSL_CERT_FILE.
DOMAIN = os.environ.get("KEEPSTATE_TEST_DOMAIN") or None


def client_env(url: str, key: str) -> dict[str, str | None]:
    """What the SDK is told to reach the server at `url` (None: unset): only E2B_DOMAIN when it is the shared server
    and the run says so (KEEPSTATE_TEST_DOMAIN), else E2B_API_URL and E2B_SANDBOX_URL, as before the next major SDK
    drops them."""
    if DOMAIN and url == os.environ.get("KEEPSTATE_TEST_API"):
        return {"E2B_DOMAIN": DOMAIN, "E2B_API_URL": None, "E2B_SANDBOX_URL": None, "E2B_API_KEY": key}
    return {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": key, "E2B_DOMAIN": None}


def apply_env(values: dict[str, str | None], env: dict[str, str] | None = None) -> dict[str, str]:
    """Set (None: unset) `values` in `env`, os.environ by default; returns the mapping changed."""
    target: Any = os.environ if env is None else env
    for k, v in values.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = v
    return target  # type: ignore[no-any-return]


def wait_until(predicate: Callable[[], T], timeout: float, what: str | Callable[[], str], every: float = 0.1) -> T:
    """Poll `predicate` until it returns something true and return that, or fail after `timeout` seconds with a
    message naming `what` (a callable: asked then, to describe the state given up on). For effects that land
    asynchronously: wait for them, never sleep a guessed time instead."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            described = what() if callable(what) else what
            raise AssertionError(f"gave up after {timeout:g} s waiting for {described} (last: {value!r})")
        time.sleep(every)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_health(url: str, proc: subprocess.Popen[bytes] | None = None, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy")


@dataclass
class Server:
    url: str
    key: str
    home: str
    proc: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        return {**os.environ, "KEEPSTATE_HOME": self.home, "KEEPSTATE_TEMPLATE_CACHE": TEMPLATE_CACHE}


def fake_internet() -> dict[str, Any] | None:
    """The fake internet this test run is linked to (the state JSON `keepstate.testing.internet up` wrote, named by
    KEEPSTATE_FAKE_INTERNET: addresses, names, DNS, SOCKS, CA file), or None when there is none."""
    path = os.environ.get("KEEPSTATE_FAKE_INTERNET")
    if not path:
        return None
    with open(path) as f:
        state: dict[str, Any] = json.load(f)
    return state


def _netns_id(pid: str) -> tuple[int, int]:
    st = os.stat(f"/proc/{pid}/ns/net")
    return st.st_dev, st.st_ino


def isolated() -> bool:
    """Whether this process runs outside the host's root network namespace (scripts/isolated.sh): compared with
    pid 1's namespace, or kthreadd's (pid 2, a kernel thread) where pid 1's is unreadable; False when unsure.
    Mirrors keepstate.testing.internet.in_root_netns (no keepstate imports here)."""
    own = _netns_id("self")
    try:
        return _netns_id("1") != own
    except OSError:
        pass
    try:
        with open("/proc/2/comm") as f:
            if f.read().strip() == "kthreadd":
                return _netns_id("2") != own
    except OSError:
        pass
    return False


def fake_internet_flags() -> tuple[str, ...]:
    """`serve` flags that point a server at the fake internet (its resolver, its test CA), when there is one."""
    state = fake_internet()
    if state is None:
        return ()
    return ("--dns-upstream", str(state["dns"]), "--egress-ca-bundle", str(state["ca_file"]))


def start_server(home: str, port: int | None = None, pool: int = 2, extra: tuple[str, ...] = (),
                 template_cache: str | None = None) -> Server:
    """Start `keepstate serve` in its own process group, as a user would (pointed at the fake internet, if any)."""
    port = port or free_port()
    env = {**os.environ, "KEEPSTATE_HOME": home, "KEEPSTATE_TEMPLATE_CACHE": template_cache or TEMPLATE_CACHE}
    log = open(Path(home) / "server.log", "ab")
    proc = subprocess.Popen([str(KEEPSTATE), "serve", "--listen", f"127.0.0.1:{port}", "--pool-size", str(pool),
                             *fake_internet_flags(), *extra], env=env, stdout=log, stderr=log,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_health(url, proc)
    return Server(url=url, key="", home=home, proc=proc)


def make_key(home: str) -> str:
    env = {**os.environ, "KEEPSTATE_HOME": home}
    return subprocess.check_output([str(KEEPSTATE), "keys", "create", "sdk-tests"], env=env,
                                   stderr=subprocess.DEVNULL).decode().strip()


def has_snapshot_modes(sandbox_class: type) -> bool:
    """Whether this SDK release names the kinds of pause (`pause(mode=...)`); e2b 2.50 has only `keep_memory`."""
    return "mode" in inspect.signature(sandbox_class.pause).parameters


def pause_files(sbx: Any) -> bool:
    """A filesystem-only pause in the SDK's words: `mode="filesystem"` (newest), `keep_memory=False` (2.50)."""
    if has_snapshot_modes(type(sbx)):
        return bool(sbx.pause(mode="filesystem"))
    return bool(sbx.pause(keep_memory=False))


def start_marker(sbx: Any) -> str:
    """Start a process that only this instance's memory holds; `survived` tells whether it is still there (a
    restore of memory keeps it, a new boot does not). Not `boot_id`: sandboxes restored from one boot image
    (docs/design/boot-images.md) share it."""
    marker = f"sleep {secrets.randbelow(10**6) + 10**6}"
    sbx.commands.run(marker, background=True)
    # A background command is answered once its process starts: the shell that runs it may not have exec'd `sleep`
    # yet (fresh-clone run 8 saw exactly that under load), so look until it has.
    wait_until(lambda: survived(sbx, marker), 30, f"`{marker}` to run")
    return marker


def survived(sbx: Any, marker: str) -> bool:
    return bool(sbx.commands.run(f"pgrep -fx '{marker}' || true").stdout.strip())


# Written into a sandbox and run as `python3 scan.py <hex> [<hex>...]`: every process's environment and command
# line and every regular file (but /proc, /sys, /dev; up to 64 MiB each) searched for the given byte strings;
# prints JSON {"found": [paths], "files": count}. For values that must never enter a sandbox (secrets, keys).
SCAN = r"""
import json, os, stat, sys

keys = [bytes.fromhex(h) for h in sys.argv[1:]]
found, files = [], 0


def check(path, data):
    for k in keys:
        if k in data:
            found.append(path)


for pid in os.listdir("/proc"):
    if pid.isdigit():
        for what in ("environ", "cmdline"):
            try:
                with open(f"/proc/{pid}/{what}", "rb") as f:
                    check(f"/proc/{pid}/{what}", f.read())
            except OSError:
                pass
for top, dirs, names in os.walk("/"):
    if top == "/":
        dirs[:] = [d for d in dirs if d not in ("proc", "sys", "dev")]
    for name in names:
        path = os.path.join(top, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_size > 64 << 20:
                continue
            with open(path, "rb") as f:
                check(path, f.read())
            files += 1
        except OSError:
            pass
print(json.dumps({"found": found, "files": files}))
"""


class BusyCores:
    """Keeps `count` CPUs busy (a spinning python3 each) while the block runs: the load under which a race between a
    restore and its first request shows."""

    def __init__(self, count: int = 2) -> None:
        self.count = count
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> BusyCores:
        for _ in range(self.count):
            self.procs.append(subprocess.Popen(["python3", "-c", "while True: pass"]))
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
