"""The gVisor runtime: one sandbox is one `runsc` container on the systrap platform.

The template root is mounted read-only under gVisor's own overlay, whose upper layer lives inside the sentry, so
the sandbox's file writes are part of every checkpoint image. That layer is backed by a disk of the sandbox's own
(`--overlay2=root:dir=…`, a loop-mounted sparse ext4 image of the sandbox's quota; docs/design/sandbox-disk.md),
or, for sandboxes and checkpoints from before the disk (`disk_mb` 0), by memory (`root:memory`).
Each sandbox runs in its own network namespace (see network.py) and cgroup.

Every `runsc` command runs in a private mount namespace with a tmpfs over /proc/sys/net:
runsc 20240729 decides "am I in the root network namespace" by the existence of
/proc/sys/net/core/rmem_default, which exists in every namespace on kernels this new, and
would refuse to start (docs: shared host-notes).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import keepstate
from keepstate.mountpoints import (
    AGENT_PACKAGE,
    AGENT_RUNTIME,
    TEMPLATE_VIEW,
    VOLUME_MOUNTS_ENV,
    VOLUME_SLOTS,
    VOLUMES_DIR,
)
from keepstate.ports import AGENT_PORT

from . import affinity, cgroups, network, remains
from . import agent_runtime as agent_rt
from .base import Endpoint, Handle, Leftover, RuntimeFailure, SandboxSpec, host_cpu_flags
from .runsc_state import container_state, container_states

log = logging.getLogger("keepstate.runtime")

__all__ = ["GVisorRuntime", "HostSlots", "host_cpu_flags", "runsc_release", "have_runsc", "oci_spec"]

CGROUP_PARENT = cgroups.CGROUP_PARENT
KILL_TIMEOUT = 10.0  # seconds a SIGKILLed sandbox may take to be gone before its teardown counts as failed
_CAPS = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE", "CAP_SYS_PTRACE", "CAP_SYS_ADMIN",
]
_SHIM = "mount --make-rprivate / && mount -t tmpfs none /proc/sys/net && exec \"$@\""
# The same, first mounting the sandbox's disk ($1 on $2) in that private namespace: the sandbox inherits the mount,
# no other namespace sees it, and it goes (loop device and all) with the sandbox's last process.
_SHIM_DISK = ("mount --make-rprivate / && mount -t tmpfs none /proc/sys/net && "
              "mount -o loop,nodev,nosuid,noexec \"$1\" \"$2\" && shift 2 && exec \"$@\"")
# Volume i is mounted at VOLUMES_DIR/i and bind-mounted at its path by the agent (VOLUME_MOUNTS_ENV): runsc
# creates a missing mount point in the root's host directory, which is the template's and shared, so every mount
# point of the spec exists in every build (template/builder.py makes them).
_DISK_FORMAT = ["-q", "-F", "-O", "^has_journal", "-E", "lazy_itable_init=1,nodiscard", "-m", "0"]


# Which agent runtime an instance runs on (its digest), beside its bundle and in every checkpoint image of it:
# a restore mounts that runtime again (docs/design/agent-runtime.md).
RUNTIME_FILE = "agent-runtime"


def agent_command() -> list[str]:
    # tini is PID 1: it reaps orphans so the agent does not have to. Both come from the agent runtime, not the image.
    return agent_rt.agent_argv()


def oci_spec(spec: SandboxSpec, link: network.Link, lib_dir: Path, rt_dir: Path) -> dict[str, Any]:
    """The OCI bundle config for a sandbox: pure, so tests can check it without runsc."""
    if len(spec.mounts) > VOLUME_SLOTS:
        raise RuntimeFailure(f"a sandbox mounts at most {VOLUME_SLOTS} volumes")
    limits = spec.limits
    caps = list(_CAPS)
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": agent_command(),
            "env": [
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "HOME=/root",
                "LANG=C.UTF-8",
                f"{VOLUME_MOUNTS_ENV}=" + json.dumps([[f"{VOLUMES_DIR}/{i}", m.destination]
                                                         for i, m in enumerate(spec.mounts)]),
            ],
            "cwd": "/",
            "capabilities": {k: caps for k in ("bounding", "effective", "inheritable", "permitted")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1048576, "soft": 1048576}],
            "noNewPrivileges": False,
        },
        # Writable from inside, yet the template directory is never written: --overlay2 puts every write in an
        # upper layer that belongs to this sandbox alone.
        "root": {"path": str(spec.template.rootfs), "readonly": False},
        "hostname": spec.hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/opt/keepstate/lib/keepstate", "type": "bind", "source": str(lib_dir),
             "options": ["rbind", "ro"]},
            {"destination": AGENT_RUNTIME, "type": "bind", "source": str(rt_dir), "options": ["rbind", "ro"]},
            {"destination": TEMPLATE_VIEW, "type": "bind", "source": str(spec.template.rootfs),
             "options": ["rbind", "ro"]},
            # Volumes: served by the gofer (file-access-mounts=shared), outside the checkpoint image.
            *({"destination": f"{VOLUMES_DIR}/{i}", "type": "bind", "source": str(m.source),
               "options": ["rbind", "rw"]} for i, m in enumerate(spec.mounts)),
        ],
        "linux": {
            "namespaces": [
                {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
                {"type": "network", "path": link.netns_path},
            ],
            "cgroupsPath": f"/{CGROUP_PARENT}/{spec.name}",
            "resources": {
                "memory": {"limit": limits.memory_mb * 1024 * 1024},
                # shares: under contention each sandbox gets CPU in proportion to its limit, so a busy one cannot
                # slow its neighbours' commands beyond its share (the quota only caps it).
                "cpu": {"quota": int(limits.cpu * 100_000), "period": 100_000, "shares": int(limits.cpu * 1024)},
                "pids": {"limit": limits.pids},
            },
        },
    }


def runsc_release() -> str:
    """The runsc release date, e.g. "20240729": a checkpoint restores only on the same one."""
    out = subprocess.run(["runsc", "--version"], capture_output=True, text=True).stdout
    m = re.search(r"(20\d{6})", out)
    if not m:
        raise RuntimeFailure("runsc not found or unrecognised version; run `make setup` as root")
    return m.group(1)


class HostSlots:
    """The host-wide slot table under /run/keepstate/slots (runtime/network.py)."""

    max_slots = network.MAX_SLOTS

    def claim(self, slot: int) -> bool:
        return network.claim_slot(slot)

    def record_owner(self, slot: int, home: str, name: str) -> None:
        network.record_slot_owner(slot, home, name)

    def owner(self, slot: int) -> str | None:
        return network.slot_owner(slot)

    def held(self, slot: int) -> bool:
        return network.slot_held(slot)

    def release(self, slot: int) -> None:
        network.release_slot(slot)

    def orphaned(self) -> list[tuple[int, str]]:
        return network.orphaned_slots()

    def owned(self, home: str) -> list[tuple[int, str]]:
        return network.owned_slots(home)


class GVisorRuntime:
    kind = "gvisor"

    def __init__(self, state_dir: Path, runsc_root: Path | None = None) -> None:
        self.state_dir = state_dir
        # KEEPSTATE_RUNSC_ROOT: a root of its own (a server under test beside others on one host).
        self.root = runsc_root or Path(os.environ.get("KEEPSTATE_RUNSC_ROOT") or "/run/keepstate/runsc")
        self.root.mkdir(parents=True, exist_ok=True)
        self.lib_dir = Path(keepstate.__file__).resolve().parent
        self.slots = HostSlots()
        self.cpus = affinity.StartCPUs()
        self._release: str | None = None
        self._agent_runtime: agent_rt.AgentRuntime | None = None

    @property
    def release(self) -> str:
        if self._release is None:
            self._release = runsc_release()
        return self._release

    @property
    def agent_runtime(self) -> agent_rt.AgentRuntime:
        """This host's agent runtime, found or built (once; the first build of a host downloads the agent's
        wheels)."""
        if self._agent_runtime is None:
            try:
                self._agent_runtime = agent_rt.ensure(lambda msg: log.info("%s", msg))
            except agent_rt.RuntimeBuildError as exc:
                raise RuntimeFailure(f"no agent runtime: {exc}") from exc
        return self._agent_runtime

    def prepare(self, open_ports: tuple[int, ...] = ()) -> None:
        """The agent runtime, built before the first sandbox. (The host's firewall is the egress datapath's:
        Egress.prepare_host installs it before this runs.)"""
        self.agent_runtime  # noqa: B018 - built before the first sandbox, not inside a create

    # -- helpers -------------------------------------------------------------------
    def _global_flags(self, disk: Path | None) -> list[str]:
        # The overlay's medium matters only to run and restore (and must match the image's on restore).
        overlay = f"root:dir={disk}" if disk else "root:memory"
        return [
            f"--root={self.root}", "--platform=systrap", "--network=sandbox",
            f"--overlay2={overlay}", "--net-disconnect-ok",
        ]

    @staticmethod
    def _env() -> dict[str, str]:
        """runsc's environment: PATH only. Its gofer and sandbox live as long as the sandbox, and whatever else the
        server's environment holds (a provider's API key named by the gateway's `api_key_env`) would sit in their
        /proc/<pid>/environ on the host all that time."""
        return {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}

    def _runsc(self, *args: str, timeout: float = 60, log: Path | None = None,
               detach_io: bool = False, disk: tuple[Path, Path] | None = None,
               cpu: int | None = None) -> subprocess.CompletedProcess[str]:
        """`disk`: (image, mount point) to mount for the sandbox this command starts. `cpu`: the one CPU it and the
        processes it starts run on (affinity.py)."""
        if disk is None:
            cmd = ["unshare", "-m", "--", "sh", "-c", _SHIM, "sh", "runsc", *self._global_flags(None), *args]
        else:
            cmd = ["unshare", "-m", "--", "sh", "-c", _SHIM_DISK, "sh", str(disk[0]), str(disk[1]), "runsc",
                   *self._global_flags(disk[1]), *args]
        if cpu is not None:
            cmd = ["taskset", "-c", str(cpu), *cmd]
        if detach_io:
            # The sandbox outlives us: give it its own session and files, not our pipes.
            assert log is not None
            with open(log, "ab") as out:
                proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                      timeout=timeout, start_new_session=True, env=self._env())
            return subprocess.CompletedProcess(cmd, proc.returncode, "", "")
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self._env())

    def _dir(self, name: str) -> Path:
        return self.state_dir / name

    def _bundle(self, spec: SandboxSpec, link: network.Link, rt: agent_rt.AgentRuntime) -> Path:
        bundle = self._dir(spec.name) / "bundle"
        bundle.mkdir(parents=True, exist_ok=True)
        (self._dir(spec.name) / RUNTIME_FILE).write_text(rt.digest + "\n")
        mount_point = spec.template.rootfs / AGENT_RUNTIME.lstrip("/")
        if not mount_point.is_dir():
            # A build from before the runtime: runsc would make the point in this shared directory itself.
            mount_point.mkdir(parents=True, exist_ok=True)
        (bundle / "config.json").write_text(json.dumps(oci_spec(spec, link, self.lib_dir, rt.path), indent=1))
        return bundle

    def _runtime_for(self, spec: SandboxSpec, image_dir: Path | None) -> agent_rt.AgentRuntime:
        """The current runtime for a new boot; for a restore the one its image was taken with."""
        recorded = image_dir / RUNTIME_FILE if image_dir is not None else None
        if recorded is None or not recorded.is_file():
            return self.agent_runtime  # a new boot, or an image from before the runtime was recorded
        digest = recorded.read_text().strip()
        if digest == self.agent_runtime.digest:
            return self.agent_runtime
        found = agent_rt.find(digest)
        if found is None:
            raise RuntimeFailure(f"the image of {spec.name} was taken on agent runtime {digest[:16]}, which this "
                                 f"host does not have (its own is {self.agent_runtime.digest[:16]})")
        return found

    def _disk(self, spec: SandboxSpec) -> tuple[Path, Path] | None:
        """A fresh disk for the sandbox's writable layer: a copy of a pre-formatted sparse image of its quota
        (copying the few MiB a format writes takes ~8 ms; formatting ~35 ms)."""
        mb = spec.limits.disk_mb
        if mb <= 0:
            return None
        formatted = self.state_dir / "disks" / f"ext4-{mb}m.img"
        if not formatted.exists():
            formatted.parent.mkdir(parents=True, exist_ok=True)
            tmp = formatted.with_name(f".{formatted.name}.{os.getpid()}.{time.monotonic_ns()}")
            with open(tmp, "wb") as f:
                f.truncate(mb << 20)
            made = subprocess.run(["mkfs.ext4", *_DISK_FORMAT, str(tmp)], capture_output=True, text=True)
            if made.returncode != 0:
                tmp.unlink(missing_ok=True)
                raise RuntimeFailure(f"cannot format a {mb} MiB disk for {spec.name}: {made.stderr.strip()}")
            os.replace(tmp, formatted)  # several creates may race here: each made a whole one
        image, mount = self._dir(spec.name) / "disk.img", self._dir(spec.name) / "disk"
        mount.mkdir(parents=True, exist_ok=True)
        copied = subprocess.run(["cp", "--sparse=always", str(formatted), str(image)], capture_output=True,
                                text=True)
        if copied.returncode != 0:
            raise RuntimeFailure(f"cannot make the disk of {spec.name}: {copied.stderr.strip()}")
        return image, mount

    def _handle(self, spec: SandboxSpec, link: network.Link) -> Handle:
        return Handle(spec.name, link.slot, Endpoint(link.sandbox_ip, AGENT_PORT))

    def _fail(self, what: str, name: str, proc: subprocess.CompletedProcess[str]) -> RuntimeFailure:
        log = self._dir(name) / "runsc.log"
        tail = ""
        if log.exists():
            tail = log.read_text(errors="replace")[-800:]
        return RuntimeFailure(f"runsc {what} of {name} failed ({proc.returncode}): "
                              f"{_gist(proc.stderr or '')} {_gist(tail)}".strip())

    # -- Runtime -------------------------------------------------------------------
    def create(self, spec: SandboxSpec, slot: int) -> Handle:
        rt = self._runtime_for(spec, None)
        disk = self._disk(spec)
        link = network.link_for(slot)
        network.create(link)
        bundle = self._bundle(spec, link, rt)
        log = self._dir(spec.name) / "runsc.log"
        proc = self._runsc("run", "--detach", f"--bundle={bundle}", spec.name, log=log, detach_io=True,
                           disk=disk)
        if proc.returncode != 0:
            self._undo(self._handle(spec, link))
            raise self._fail("run", spec.name, proc)
        return self._handle(spec, link)

    def _undo(self, handle: Handle) -> None:
        """Tear down what a failed start left, keeping the start's failure the one raised."""
        try:
            self.destroy(handle)
        except RuntimeFailure as exc:
            log.warning("after a failed start: %s", exc)

    def state(self, name: str) -> str:
        # From runsc's state file, never `runsc state`: that hangs on a frozen sandbox (runsc_state.py).
        return container_state(self.root, name)

    def is_alive(self, handle: Handle) -> bool:
        # paused: frozen by a checkpoint in progress; unknown: its state file could not be read, never taken as dead
        return self.state(handle.name) in ("running", "paused", "unknown")

    def checkpoint(self, handle: Handle, image_dir: Path, leave_running: bool = True) -> None:
        image_dir.mkdir(parents=True, exist_ok=True)
        # Uncompressed: the store compresses chunk by chunk, after deduplication.
        args = ["checkpoint", f"--image-path={image_dir}", "--compression=none", "--exclude-committed-zero-pages"]
        if leave_running:
            args.append("--leave-running")
        cgroups.thaw(handle.name)  # runsc talks to the sentry: an idle-frozen one would never answer
        proc = self._runsc(*args, handle.name, timeout=600)
        if proc.returncode == 0 and (self._dir(handle.name) / RUNTIME_FILE).is_file():
            shutil.copyfile(self._dir(handle.name) / RUNTIME_FILE, image_dir / RUNTIME_FILE)
        if proc.returncode != 0:
            # The whole of what runsc said (a state-encoding panic names the object under its stack) goes
            # to the log and beside the sandbox: the error itself carries only the gist.
            log.warning("runsc checkpoint of %s failed (%d):\n%s", handle.name, proc.returncode, proc.stderr)
            raise RuntimeFailure(f"runsc checkpoint of {handle.name} failed ({proc.returncode}): "
                                 f"{_gist(proc.stderr)}")

    def freeze(self, handle: Handle) -> None:
        cgroups.thaw(handle.name)
        proc = self._runsc("pause", handle.name, timeout=30)
        if proc.returncode != 0:
            raise RuntimeFailure(f"runsc pause of {handle.name} failed ({proc.returncode}): {_gist(proc.stderr)}")

    def thaw(self, handle: Handle) -> None:
        cgroups.thaw(handle.name)
        proc = self._runsc("resume", handle.name, timeout=30)
        if proc.returncode != 0:
            raise RuntimeFailure(f"runsc resume of {handle.name} failed ({proc.returncode}): {_gist(proc.stderr)}")

    def export_files(self, handle: Handle, dest: Path) -> int:
        if self.state(handle.name) != "running":
            raise RuntimeFailure(f"{handle.name} is {self.state(handle.name)}: only a running sandbox exports files")
        cgroups.thaw(handle.name)
        argv = agent_rt.loader_argv(AGENT_RUNTIME, "bin/python3", "-I", "-S", "-B",
                                    f"{AGENT_PACKAGE}/keepstate/agent/boot.py", "export-files")
        cmd = ["runsc", *self._global_flags(None), "exec", "--user=0:0", handle.name, *argv]
        with open(dest, "wb") as out:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.PIPE, timeout=600,
                                  env=self._env())
        if proc.returncode != 0:
            raise RuntimeFailure(f"export of {handle.name}'s files failed ({proc.returncode}): "
                                 f"{_gist(proc.stderr.decode(errors='replace'))}")
        return dest.stat().st_size

    def restore(self, spec: SandboxSpec, image_dir: Path, slot: int) -> Handle:
        rt = self._runtime_for(spec, image_dir)
        disk = self._disk(spec)
        link = network.link_for(slot)
        network.create(link)
        bundle = self._bundle(spec, link, rt)
        log = self._dir(spec.name) / "runsc.log"
        with self.cpus.one() as cpu:
            proc = self._runsc("restore", "--detach", f"--image-path={image_dir}", f"--bundle={bundle}",
                               spec.name, timeout=600, log=log, detach_io=True, disk=disk, cpu=cpu)
            if proc.returncode != 0:
                self._undo(self._handle(spec, link))
                raise self._fail("restore", spec.name, proc)
            if cpu is not None:
                self._unpin(spec.name)
        return self._handle(spec, link)

    def _unpin(self, name: str) -> None:
        """Every CPU again for the restored sandbox's threads (its sentry's, its stubs', its gofer's)."""
        folders = cgroups.paths(CGROUP_PARENT, name)
        daemons = remains.container_pids(self.root, name)  # its sandbox and gofer: fixed once it runs
        affinity.unpin(lambda: cgroups.pids(folders) | affinity.threads(daemons), self.cpus.all)

    def idle_freeze(self, handle: Handle) -> None:
        if not cgroups.freeze(handle.name):
            raise RuntimeFailure(f"sandbox {handle.name} has no cgroup to freeze (is it gone?)")

    def idle_thaw(self, handle: Handle) -> None:
        cgroups.thaw(handle.name)

    def idle_frozen(self, handle: Handle) -> bool:
        return cgroups.frozen(handle.name)

    def destroy(self, handle: Handle) -> None:
        """Kill its processes through its cgroups, remove runsc's files of it, then what else is left, its state
        folder last so that while anything remains the folder names the instance (docs/design/teardown.md).

        No runsc command at all: under load each is a slow process start (`runsc kill` and `runsc state` timed
        out after 20 s with 100 sandboxes), and `runsc delete --force` waits until init has reaped the sandbox's
        processes, which on this host's init takes 1.2 s idle and over a minute under load. Once its processes are
        dead a sandbox holds nothing runsc would release but those files."""
        name = handle.name
        alive = cgroups.kill_all(CGROUP_PARENT, name, timeout=KILL_TIMEOUT)
        alive += [pid for pid in remains.container_pids(self.root, name) if _kill_ours(pid, name)]
        if alive:
            raise RuntimeFailure(f"destroy of {name}: processes {alive[:8]} still alive {KILL_TIMEOUT:.0f}s after "
                                 "SIGKILL")
        for p in remains.container_files(self.root, name):
            p.unlink(missing_ok=True)
        if handle.slot >= 0:  # -1: the slot is no longer this sandbox's; leave its network alone
            network.destroy(network.link_for(handle.slot))
        stuck = cgroups.remove(CGROUP_PARENT, name)
        remains.detach_loops(self._dir(name))
        for p in remains.shm_of(name):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        left = {f"{r.kind} {r.where}" for r in self.remains(handle) if r.kind != "state"}
        left.update(f"cgroup {p}" for p in stuck)
        if left:
            raise RuntimeFailure(f"destroy of {name} left {', '.join(sorted(left))}")
        shutil.rmtree(self._dir(name), ignore_errors=True)
        if self._dir(name).exists():
            raise RuntimeFailure(f"destroy of {name}: cannot remove {self._dir(name)}")

    def remains(self, handle: Handle) -> list[Leftover]:
        name = handle.name
        out = [Leftover("container", name, str(p)) for p in remains.container_files(self.root, name)]
        out += [Leftover("cgroup", name, str(p)) for p in cgroups.paths(CGROUP_PARENT, name)]
        if handle.slot >= 0:
            link = network.link_for(handle.slot)
            if Path(link.netns_path).exists():
                out.append(Leftover("netns", name, link.netns_path))
            if network.has_interface(link.host_if):
                out.append(Leftover("veth", name, link.host_if))
        out += [Leftover("loop", name, dev) for dev in remains.loops_backed_by(self._dir(name))]
        out += [Leftover("shm", name, str(p)) for p in remains.shm_of(name)]
        if self._dir(name).exists():
            out.append(Leftover("state", name, str(self._dir(name))))
        return out

    def inventory(self, home: Path) -> list[Leftover]:
        """The instances of `home` are those with a state folder here, a slot recorded for `home`, or a runsc
        container whose bundle is here."""
        slots = dict((name, slot) for slot, name in network.owned_slots(str(home)))
        names = set(slots)
        try:
            names.update(p.name for p in self.state_dir.iterdir() if p.is_dir() and p.name != "disks")
        except OSError:
            pass
        here = str(self.state_dir).rstrip("/") + "/"
        names.update(n for n, bundle in remains.containers(self.root).items()
                     if bundle is not None and str(bundle).startswith(here))
        out: list[Leftover] = []
        for name in sorted(names):
            slot = slots.get(name, -1)
            out += self.remains(Handle(name, slot))
            if slot >= 0:
                out.append(Leftover("slot", name, f"{network.SLOTS_DIR}/{slot}"))
        return out

    def cgroup_stats(self, handle: Handle) -> dict[str, int]:
        base = Path("/sys/fs/cgroup")
        rel = f"{CGROUP_PARENT}/{handle.name}"
        out: dict[str, int] = {}

        def read(controller: str, leaf: str) -> str | None:
            try:
                return (base / controller / rel / leaf).read_text()
            except OSError:
                return None

        if (v := read("cpuacct", "cpuacct.usage")) is not None:
            out["cpu_ns"] = int(v)
        if (v := read("memory", "memory.usage_in_bytes")) is not None:
            out["mem_used"] = int(v)
        if (v := read("memory", "memory.limit_in_bytes")) is not None:
            out["mem_limit"] = int(v)
        if (v := read("memory", "memory.stat")) is not None:
            stat = dict(line.split() for line in v.splitlines() if line.count(" ") == 1)
            out["mem_cache"] = int(stat.get("total_cache", stat.get("cache", 0)))
            out["mem_used"] = out.get("mem_used", 0) - out["mem_cache"]
        if (v := read("cpu", "cpu.cfs_quota_us")) is not None:
            out["cpu_quota_us"] = int(v)
        return out

    def statuses(self) -> dict[str, str]:
        return container_states(self.root)  # not `runsc list`: it hangs on any frozen sandbox under the root


def _kill_ours(pid: int, name: str) -> bool:
    """SIGKILL a process runsc recorded for the sandbox `name` if it is still that one (its command line names the
    sandbox: a pid may have been reused); whether it is still alive."""
    try:
        if name.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False
        os.kill(pid, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        return False
    deadline = time.monotonic() + KILL_TIMEOUT
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            return False
        if state == "Z":
            return False
        time.sleep(0.02)
    return True


def have_runsc() -> bool:
    return shutil.which("runsc") is not None and os.geteuid() == 0


def _gist(text: str, limit: int = 800) -> str:
    """What runsc said, shortened: for a Go panic its message and the frames that raised it (for a state-encoding
    panic they name the kernel object being saved), else the last `limit` characters."""
    text = text.strip()
    cut = text.find("\ngoroutine ")
    if cut > 0:
        head, stack = text[:cut].strip(), text[cut:].splitlines()
        frames = [line.split("(0x")[0].split("({")[0] for line in stack if line and not line[0].isspace()]
        raised = next((i for i, f in enumerate(frames) if f.startswith("panic")), None)
        if raised is not None and frames[raised + 1:]:
            head += " at " + " < ".join(frames[raised + 1:raised + 4])
        return head[:limit]
    return text[-limit:]

