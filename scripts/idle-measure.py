"""N idle sandboxes: the sum of their cgroups' cpuacct.usage over a window, and a command's latency into a frozen vs an awake one (docs/design/idle.md). Usage: idle-measure.py HOME N SECONDS on|off SERVER_PID, with E2B_API_URL etc. set."""
import os, sys, time, sqlite3, statistics
from concurrent.futures import ThreadPoolExecutor
from e2b import Sandbox
home, n, window, mode = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
server_pid = int(sys.argv[5])
def rname(sid):
    db = sqlite3.connect(f"file:{home}/catalog.sqlite?mode=ro", uri=True, timeout=10)
    return db.execute("select runtime_name from sandboxes where sandbox_id=?", (sid,)).fetchone()[0]
def fstate(name): return open(f"/sys/fs/cgroup/freezer/keepstate/{name}/freezer.state").read().strip()
def cpu(name): return int(open(f"/sys/fs/cgroup/cpuacct/keepstate/{name}/cpuacct.usage").read())
def proc_cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
with ThreadPoolExecutor(5) as ex:
    sbxs = list(ex.map(lambda _: Sandbox.create(timeout=600), range(n)))
try:
    for s in sbxs: s.commands.run("true")
    names = [rname(s.sandbox_id) for s in sbxs]
    time.sleep(8)  # past the freeze delay (2 s + the agent's two looks)
    print(mode, "frozen:", sum(fstate(x) == "FROZEN" for x in names), "of", n)
    a = [cpu(x) for x in names]; sa = proc_cpu(server_pid); t = time.monotonic()
    time.sleep(window)
    b = [cpu(x) for x in names]; sb = proc_cpu(server_pid); el = time.monotonic() - t
    tot = sum(b) - sum(a)
    print(f"{mode}: {n} idle sandboxes, {el:.1f} s: {tot/1e9:.3f} CPU-s = {tot/1e9/el*100:.2f} % of a core in total,"
          f" {tot/1e9/el*100/n:.2f} % each; server process {(sb-sa)/el*100:.2f} % of a core")
    if mode == "on":
        s, name = sbxs[0], names[0]
        awake, frozen = [], []
        for i in range(10):
            while fstate(name) != "FROZEN": time.sleep(0.05)
            t = time.perf_counter(); s.commands.run("true"); frozen.append((time.perf_counter() - t) * 1000)
            time.sleep(1.0)  # awake still (not yet 2 s quiet)
            assert fstate(name) == "THAWED"
            t = time.perf_counter(); s.commands.run("true"); awake.append((time.perf_counter() - t) * 1000)
        print(f"command `true`: awake median {statistics.median(awake):.1f} ms (min {min(awake):.1f}), "
              f"frozen median {statistics.median(frozen):.1f} ms (min {min(frozen):.1f})")
finally:
    for s in sbxs: s.kill()
