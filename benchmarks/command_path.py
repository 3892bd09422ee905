"""Where a `commands.run("true")` spends its time: one hop at a time, medians of interleaved rounds.

    python benchmarks/command_path.py [--rounds 40]

Starts its own KeepState server (pool of 2 `base` sandboxes), creates one sandbox with the stock e2b SDK and
times, round-robin so that the host's noise falls on every variant alike:
  * sdk        sbx.commands.run("true") back to back (what benchmarks/sandbox.py times), and after 0.5 s idle;
               then, apart from the rounds, as many commands one after another with no pause
  * router     one raw Connect Start (`/bin/bash -l -c true`) through the server's router, httpx keep-alive
  * direct     the same request straight to the agent (the sandbox's address, port 49983)
  * direct -c  `/bin/bash -c true` (no login scripts), straight to the agent
  * direct true  `/usr/bin/true` (no bash at all), straight to the agent
and, inside the sandbox, a new process alone (posix_spawn of a static program, of `true`, `bash -c true`,
`bash -l -c true`, as the agent starts commands; a bash subshell's fork; a fork of python3), plus a
`PS4='+ $EPOCHREALTIME '` trace of the login scripts. Also lists the HTTP requests one
Sandbox.create() + commands.run() makes. Every request goes to loopback or to the sandbox's address.
"""

from __future__ import annotations

import argparse
import base64
import sqlite3
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, pct, server  # noqa: E402

START = "/process.Process/Start"
# Run in the sandbox: what a new process costs there, started as the agent starts commands (posix_spawn, a vfork
# and an exec), and by a fork. The floor of any command that is given a process of its own when it comes.
FLOOR = r"""
import os, statistics, time
def timed(go, n=30):
    go()
    xs = []
    for _ in range(n):
        t = time.perf_counter(); go(); xs.append((time.perf_counter() - t) * 1000)
    return statistics.median(xs)
def spawned(*argv):
    def go():
        os.waitpid(os.posix_spawn(argv[0], list(argv), {"PATH": "/usr/bin:/bin"},
                                  file_actions=[(os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0)]), 0)
    return go
def forked():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
rows = [("posix_spawn a static program (ldconfig --version)", timed(spawned("/sbin/ldconfig", "--version"))),
        ("posix_spawn /usr/bin/true (dynamic)", timed(spawned("/usr/bin/true"))),
        ("posix_spawn bash -c true", timed(spawned("/bin/bash", "-c", "true"))),
        ("posix_spawn bash -l -c true", timed(spawned("/bin/bash", "-l", "-c", "true"))),
        ("fork of this python3", timed(forked))]
loop = timed(spawned("/bin/bash", "-c", "for i in {1..30}; do ( : ); done"), 10)
rows.append(("a bash subshell ( : ): (bash -c with 30 - bash -c true) / 30", (loop - rows[2][1]) / 30))
for name, ms in rows:
    print(f"  {name:62s} p50 {ms:6.1f} ms")
"""


def envelope(message: bytes) -> bytes:
    return struct.pack(">BI", 0, len(message)) + message


def start_body(cmd: str, args: list[str]) -> bytes:
    from e2b.envd.process import process_pb

    req = process_pb.StartRequest(process=process_pb.ProcessConfig(cmd=cmd, args=args, envs={}), stdin=False)
    return envelope(req.to_binary())


def frames(raw: bytes) -> list[tuple[int, bytes]]:
    out, i = [], 0
    while i + 5 <= len(raw):
        flag, n = struct.unpack(">BI", raw[i:i + 5])
        out.append((flag, raw[i + 5:i + 5 + n]))
        i += 5 + n
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()

    with server(pool=2) as srv:
        srv.sdk_env()
        from e2b import Sandbox

        srv.wait_pool("base", 2)
        # What the SDK sends for one create + one command.
        seen: list[str] = []
        original = httpx.HTTPTransport.handle_request

        def logged(self: httpx.HTTPTransport, request: httpx.Request) -> httpx.Response:
            t = time.perf_counter()
            resp = original(self, request)
            seen.append(f"{request.method} {request.url.path} -> {resp.status_code} "
                        f"(headers after {(time.perf_counter() - t) * 1000:.1f} ms)")
            return resp

        httpx.HTTPTransport.handle_request = logged  # type: ignore[method-assign]
        t = time.perf_counter()
        sbx = Sandbox.create(timeout=600)
        t_create = (time.perf_counter() - t) * 1000
        sbx.commands.run("true")
        t_first = (time.perf_counter() - t) * 1000
        httpx.HTTPTransport.handle_request = original  # type: ignore[method-assign]
        print(f"one create {t_create:.1f} ms, create+first command {t_first:.1f} ms; its requests:")
        for line in seen:
            print("   ", line)

        db = sqlite3.connect(srv.home / "keepstate.sqlite")  # the server's database (SQLite, the default)
        (address,) = db.execute("SELECT address FROM sandboxes WHERE sandbox_id = ?", (sbx.sandbox_id,)).fetchone()
        token = sbx._envd_access_token or ""  # noqa: SLF001 - the SDK keeps it private
        headers = {"Content-Type": "application/connect+proto", "Connect-Protocol-Version": "1",
                   "Authorization": "Basic " + base64.b64encode(b"user:").decode(), "X-Access-Token": token,
                   "Keepalive-Ping-Interval": "50", "Connect-Timeout-Ms": "60000"}
        routed = {**headers, "E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
        via_router = httpx.Client(base_url=srv.url, headers=routed, trust_env=False)
        direct = httpx.Client(base_url=f"http://{address}:49983", headers=headers, trust_env=False)
        login = start_body("/bin/bash", ["-l", "-c", "true"])
        plain = start_body("/bin/bash", ["-c", "true"])
        bare = start_body("/usr/bin/true", [])

        def raw(client: httpx.Client, body: bytes) -> Callable[[], None]:
            def go() -> None:
                r = client.post(START, content=body)
                got = frames(r.content)
                assert r.status_code == 200 and got and got[-1][0] == 2 and got[-1][1] == b"{}", (r, got)
            return go

        variants: dict[str, Callable[[], None]] = {
            "sdk commands.run, after 0.5 s idle": lambda: sbx.commands.run("true") and None,
            "sdk commands.run": lambda: sbx.commands.run("true") and None,
            "router bash -l -c": raw(via_router, login),
            "direct bash -l -c": raw(direct, login),
            "direct bash -c": raw(direct, plain),
            "direct true": raw(direct, bare),
        }
        for go in variants.values():
            go()  # warm every path once
        samples: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for name, go in variants.items():
                if "idle" in name:
                    time.sleep(0.5)  # an agent thinking between commands (the spare process is made then)
                t = time.perf_counter()
                go()
                samples[name].append((time.perf_counter() - t) * 1000)
        print(f"\nround trips, {args.rounds} interleaved rounds (ms)    p50     p95")
        for name, s in samples.items():
            print(f"  {name:34s} {median(s):6.1f}  {pct(s, 95):6.1f}")
        in_a_row = []
        for _ in range(args.rounds):  # one after another with no pause, as a script's commands come
            t = time.perf_counter()
            sbx.commands.run("true")
            in_a_row.append((time.perf_counter() - t) * 1000)
        print(f"  {'sdk commands.run, ' + str(args.rounds) + ' in a row':34s} {median(in_a_row):6.1f}  "
              f"{pct(in_a_row, 95):6.1f}")

        sbx.files.write("/tmp/floor.py", FLOOR)
        print("\ninside the sandbox, as user: a new process, what it costs here before any command runs")
        print(sbx.commands.run("python3 /tmp/floor.py").stdout)
        trace = sbx.commands.run("PS4='+ $EPOCHREALTIME ${BASH_SOURCE##*/}:$LINENO ' bash -lxc true 2>&1 | head -80")
        print("login-shell trace (`bash -lxc true`):")
        print(trace.stdout)
        sbx.kill()


if __name__ == "__main__":
    main()
