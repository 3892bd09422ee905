"""A desktop sandbox (e2b-desktop) beside a `base` sandbox, in the same run, with the stock SDKs.

    python benchmarks/desktop.py [--repeat 3]

Starts its own KeepState server (no warm pool: every create boots; --standby-seconds 0 for the store figures).
Figures, each the median of --repeat:
  * create to first screenshot: `Sandbox.create()` of e2b-desktop (boot, then Xvfb and XFCE started and checked
    by the SDK) + `stream.start()` + `screenshot()`; peer: `base` create + one command;
  * a screenshot's round trip (scrot, read back, removed); peer: a `base` command's round trip;
  * pause and resume of a desktop with Chromium open on a page, by thaw (the frozen instance kept) and from the
    store (--standby-seconds 0); peer: the same for an idle `base` sandbox;
  * what the desktop's pause stored (MiB added to the store), beside base's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import row, server  # noqa: E402

MiB = 1 << 20
PAGE = "<title>bench</title><h1>a page kept across a pause</h1>"


def desktop_round(srv) -> dict[str, float]:
    from e2b_desktop import Sandbox

    t = time.perf_counter()
    desk = Sandbox.create(timeout=600)
    desk.stream.start()
    desk.screenshot()
    first = time.perf_counter() - t
    try:
        shots = []
        for _ in range(5):
            t = time.perf_counter()
            desk.screenshot()
            shots.append(time.perf_counter() - t)
        desk.files.write("/home/user/site/index.html", PAGE)
        desk.commands.run("cd /home/user/site && python3 -m http.server 8000", background=True, timeout=0)
        desk.commands.run("for i in $(seq 50); do curl -fso /dev/null localhost:8000 && break; sleep 0.2; done")
        desk.launch("google-chrome", "http://localhost:8000/")
        desk.commands.run("for i in $(seq 120); do xdotool search --onlyvisible --name bench >/dev/null && break; "
                          "sleep 0.5; done")
        pause, resume = pause_resume(Sandbox, desk.sandbox_id)
        stored = srv.added_bytes(desk.sandbox_id) / MiB
        return {"first": first, "shot": statistics.median(shots), "pause": pause, "resume": resume, "mib": stored}
    finally:
        Sandbox.kill(desk.sandbox_id)


def base_round(srv) -> dict[str, float]:
    from e2b import Sandbox

    t = time.perf_counter()
    sbx = Sandbox.create(timeout=600)
    sbx.commands.run("true")
    first = time.perf_counter() - t
    try:
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            sbx.commands.run("true")
            runs.append(time.perf_counter() - t)
        pause, resume = pause_resume(Sandbox, sbx.sandbox_id)
        return {"first": first, "shot": statistics.median(runs), "pause": pause, "resume": resume,
                "mib": srv.added_bytes(sbx.sandbox_id) / MiB}
    finally:
        Sandbox.kill(sbx.sandbox_id)


def pause_resume(cls, sandbox_id: str) -> tuple[float, float]:
    t = time.perf_counter()
    cls.pause(sandbox_id)
    paused = time.perf_counter() - t
    t = time.perf_counter()
    again = cls.connect(sandbox_id, timeout=600)
    again.commands.run("true")
    return paused, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    for mode, extra in (("thaw", ()), ("store", ("--standby-seconds", "0"))):
        with server(pool=0, extra=extra) as srv:
            srv.sdk_env()
            results[f"desktop-{mode}"] = [desktop_round(srv) for _ in range(args.repeat)]
            results[f"base-{mode}"] = [base_round(srv) for _ in range(args.repeat)]

    def med(key: str, field: str) -> float:
        return statistics.median(r[field] for r in results[key])

    print(f"desktop (e2b-desktop, 1024x768, Chromium open for the pause) beside base, median of {args.repeat}")
    print(row("create to first screenshot", med("desktop-thaw", "first") * 1000, med("base-thaw", "first") * 1000,
              peer_name="base create + command"))
    print(row("screenshot round trip", med("desktop-thaw", "shot") * 1000, med("base-thaw", "shot") * 1000,
              peer_name="base command"))
    for mode in ("thaw", "store"):
        print(row(f"pause ({mode})", med(f"desktop-{mode}", "pause") * 1000, med(f"base-{mode}", "pause") * 1000,
                  peer_name="base"))
        print(row(f"resume ({mode})", med(f"desktop-{mode}", "resume") * 1000, med(f"base-{mode}", "resume") * 1000,
                  peer_name="base"))
    print(row("pause stored", med("desktop-store", "mib"), med("base-store", "mib"), unit="MiB", peer_name="base"))


if __name__ == "__main__":
    main()
