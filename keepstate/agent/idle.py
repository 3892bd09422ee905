"""`GET /keepstate/idle` (the host's only; the router never relays it): may the host freeze this sandbox now?

Idle means: no command or PTY runs (the process table), no watcher waits for events, and every process in the
sandbox is the agent's own — tini (PID 1), the agent, its spare processes, the template's services and their
descendants (e.g. the code interpreter's Jupyter and its kernels) — with the same CPU time as at a look at least
MIN_GAP seconds earlier. A process of anyone else's (a daemon a command left behind) keeps the sandbox awake:
freezing it would stop work nobody asked to stop. The agent's own CPU time is left out: answering the host is
work too. The answer also carries the journal's last seq, so the host can check it has pulled everything first.

The pure part (`judge`) takes the process table as data; `IdleProbe` reads /proc.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

MIN_GAP = 1.0  # seconds between the two looks that must agree
KEEP = 30.0  # looks older than this are forgotten


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    cpu: int  # utime + stime, clock ticks


def parse_stat(text: str) -> Proc | None:
    """One /proc/<pid>/stat line (the command name may hold spaces and parentheses: split after the last ')')."""
    try:
        pid = int(text.split(" ", 1)[0])
        fields = text[text.rindex(")") + 2:].split()
        return Proc(pid, int(fields[1]), int(fields[11]) + int(fields[12]))
    except (ValueError, IndexError):
        return None


def read_procs(proc_dir: str = "/proc") -> dict[int, Proc]:
    out: dict[int, Proc] = {}
    for name in os.listdir(proc_dir):
        if not name.isdigit():
            continue
        try:
            with open(f"{proc_dir}/{name}/stat") as f:
                p = parse_stat(f.read())
        except OSError:
            continue  # it exited meanwhile
        if p is not None:
            out[p.pid] = p
    return out


def descendants(procs: dict[int, Proc], roots: Iterable[int]) -> set[int]:
    """The roots that exist and every process below them."""
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out: set[int] = set()
    todo = [r for r in roots if r in procs]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, ()))
    return out


def judge(procs: dict[int, Proc], agent: int, own: set[int], before: dict[int, int] | None) -> str:
    """Why the sandbox is not idle ("" if it is). `own`: the agent's other processes (tini, spares, services
    with their descendants); `before`: the CPU time of each of them at an earlier look, None if there was none."""
    strangers = sorted(set(procs) - own - {agent})
    if strangers:
        return f"processes not the agent's run: {strangers[:5]}"
    if before is None:
        return "first look"
    now = {pid: procs[pid].cpu for pid in own if pid in procs}
    if set(now) != set(before):
        return "the agent's processes changed"
    moved = [pid for pid, cpu in now.items() if cpu != before[pid]]
    if moved:
        return f"processes used CPU since the last look: {moved[:5]}"
    return ""


class IdleProbe:
    """The looks, remembered between calls: each answer compares this one with the newest look MIN_GAP older.
    `own_roots`: the spares' and services' pids (the services' descendants are the agent's too)."""

    def __init__(self, busy: Callable[[], str], own_roots: Callable[[], set[int]], last_seq: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic, proc_dir: str = "/proc") -> None:
        self._busy = busy  # why the agent itself is busy (a command runs, a watcher waits), "" if not
        self._own_roots = own_roots
        self._last_seq = last_seq
        self._clock = clock
        self._proc_dir = proc_dir
        self._looks: list[tuple[float, dict[int, int]]] = []

    def look(self) -> dict[str, Any]:
        last = self._last_seq()
        why = self._busy()
        if why:
            self._looks.clear()
            return {"idle": False, "why": why, "last": last}
        now = self._clock()
        procs = read_procs(self._proc_dir)
        agent = os.getpid()
        own = ({1} & set(procs)) | descendants(procs, self._own_roots())
        own.discard(agent)
        looks = [(t, cpu) for t, cpu in self._looks if now - t <= KEEP]
        older = [cpu for t, cpu in looks if now - t >= MIN_GAP]
        why = judge(procs, agent, own, older[-1] if older else None)
        this = (now, {pid: procs[pid].cpu for pid in own})
        # A look that found CPU used makes every earlier one useless to compare with; one that found processes not
        # the agent's, itself too.
        if why in ("", "first look"):
            self._looks = [*looks, this]
        else:
            self._looks = [] if set(procs) - own - {agent} else [this]
        return {"idle": not why, "why": why, "last": last}
