"""The agent's idle look (GET /keepstate/idle), on a /proc of the test's making: which processes are the agent's
own, and what keeps a sandbox awake. tests/sdk/test_idle.py checks the same on real sandboxes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("keepstate.agent.idle", reason="needs the agent package")

from keepstate.agent.idle import MIN_GAP, IdleProbe, Proc, descendants, judge, parse_stat  # noqa: E402

AGENT = os.getpid()


def stat_line(pid: int, ppid: int, cpu: int, comm: str = "python3") -> str:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
    return f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 0 0 0 0 0 {cpu} 0 0 0 20 0 1 0 100 0 0\n"


class FakeProc:
    def __init__(self, root: Path) -> None:
        self.root = root

    def set(self, pid: int, ppid: int, cpu: int, comm: str = "python3") -> None:
        (self.root / str(pid)).mkdir(exist_ok=True)
        (self.root / str(pid) / "stat").write_text(stat_line(pid, ppid, cpu, comm))

    def drop(self, pid: int) -> None:
        (self.root / str(pid) / "stat").unlink()
        (self.root / str(pid)).rmdir()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_parse_stat_survives_odd_command_names() -> None:
    assert parse_stat(stat_line(7, 1, 42, comm="a) b (c")) == Proc(7, 1, 42)
    assert parse_stat("garbage") is None


def test_descendants_of_services_are_the_agents_own() -> None:
    procs = {p.pid: p for p in (Proc(1, 0, 0), Proc(2, 1, 0), Proc(10, 2, 0), Proc(11, 10, 0), Proc(12, 11, 0),
                                Proc(20, 1, 0))}
    assert descendants(procs, {10, 99}) == {10, 11, 12}


def test_judge_names_strangers_changes_and_cpu_use() -> None:
    procs = {p.pid: p for p in (Proc(1, 0, 5), Proc(AGENT, 1, 50), Proc(30, AGENT, 3))}
    own = {1, 30}
    assert judge(procs, AGENT, own, None) == "first look"
    assert judge(procs, AGENT, own, {1: 5, 30: 3}) == ""
    assert "CPU" in judge(procs, AGENT, own, {1: 5, 30: 2})
    assert "changed" in judge(procs, AGENT, own, {1: 5})
    stranger = {**procs, 40: Proc(40, 1, 0)}
    assert "40" in judge(stranger, AGENT, own, {1: 5, 30: 3})


def test_two_looks_a_second_apart_without_cpu_use_are_idle(tmp_path: Path) -> None:
    proc, clock = FakeProc(tmp_path), Clock()
    proc.set(1, 0, 5, "tini")
    proc.set(AGENT, 1, 100)
    proc.set(30, AGENT, 3, "keepstate-spare")
    busy = {"why": ""}
    probe = IdleProbe(lambda: busy["why"], lambda: {30}, lambda: 17, clock=clock, proc_dir=str(tmp_path))
    assert probe.look() == {"idle": False, "why": "first look", "last": 17}
    clock.now += MIN_GAP / 2
    proc.set(AGENT, 1, 180)  # the agent's own CPU time (answering) does not count
    assert probe.look()["why"] == "first look"  # too soon after the first to tell
    clock.now += MIN_GAP / 2
    assert probe.look() == {"idle": True, "why": "", "last": 17}
    # A service used CPU: not idle, and only later looks count.
    proc.set(30, AGENT, 4)
    clock.now += MIN_GAP
    assert "CPU" in probe.look()["why"]
    clock.now += MIN_GAP
    assert probe.look()["idle"]
    # A command runs: never idle, whatever the processes look like.
    busy["why"] = "a command runs"
    clock.now += MIN_GAP
    assert probe.look() == {"idle": False, "why": "a command runs", "last": 17}
    busy["why"] = ""
    # A process left behind by a command (reparented to tini) is not the agent's: it keeps the sandbox awake.
    proc.set(50, 1, 0, "daemon")
    clock.now += MIN_GAP
    assert "50" in probe.look()["why"]
    proc.drop(50)
    clock.now += MIN_GAP
    assert probe.look()["why"] == "first look"
    clock.now += MIN_GAP
    assert probe.look()["idle"]
