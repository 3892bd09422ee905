"""The Replayer on golden histories (one deliberately divergent), run as real local processes."""

from __future__ import annotations

from pathlib import Path

from keepstate.session import GENESIS, Event, Replayer, plan, verify_events
from tests.session.conftest import LocalExecutor, load_golden


def test_golden_histories_verify() -> None:
    # pins the canonical encoding and hash: if either changes, these files stop verifying
    for name, sid in [("history_ok.json", "igolden0000000000001"), ("history_divergent.json", "igolden0000000000002")]:
        result = verify_events(sid, load_golden(name))
        assert result.ok, (name, result)


def test_replay_of_a_deterministic_history_matches(tmp_path: Path) -> None:
    executor = LocalExecutor(tmp_path)
    report = Replayer(executor).replay(load_golden("history_ok.json"))
    assert report.ok, report.divergences
    by_outcome = {o: [r.seq for r in report.results if r.outcome == o] for o in report.counts()}
    assert by_outcome["match"] == [2, 4, 5, 7, 9, 10, 11, 16, 17]
    assert by_outcome["skipped"] == [19, 20, 22]  # pty, killed by a signal, never exited
    assert (tmp_path / "home/user/out/data.csv").read_text() == "a,b\n1,2\n3,4\n"
    assert not (tmp_path / "home/user/greeting.txt").exists()
    assert executor.calls[0] == ("/bin/bash", ["-c", "echo hello > greeting.txt"], "/home/user", "user")


def test_replay_of_the_divergent_history_reports_where(tmp_path: Path) -> None:
    report = Replayer(LocalExecutor(tmp_path)).replay(load_golden("history_divergent.json"))
    assert not report.ok
    assert [(r.seq, r.expected, r.got) for r in report.divergences] == [(5, 0, 1)]
    assert [r.outcome for r in report.results] == ["match", "not_replayable", "diverged", "match"]
    stopped = Replayer(LocalExecutor(tmp_path / "again"), stop_on_divergence=True)
    assert len(stopped.replay(load_golden("history_divergent.json")).results) == 3


def _events(items: list[tuple[str, dict[str, object]]]) -> list[Event]:
    out, prev = [], GENESIS
    for i, (kind, data) in enumerate(items, 1):
        out.append(Event.make("s", i, float(i), kind, dict(data), prev))
        prev = out[-1].hash
    return out


def test_plan_drops_the_branch_a_resume_went_back_from() -> None:
    events = _events([
        ("checkpoint", {"checkpoint_id": "c1"}),
        ("process.start", {"pid": 5, "cmd": "a", "args": []}),
        ("process.exit", {"pid": 5, "exitCode": 1, "status": "exit status 1"}),  # lost with the host
        ("sandbox.resume", {"checkpoint_id": "c1", "host": "b"}),
        ("process.start", {"pid": 5, "cmd": "b", "args": []}),
        ("process.exit", {"pid": 5, "exitCode": 0, "status": "exit status 0"}),
    ])
    steps = plan(events)
    assert [(s.seq, s.skip, s.cmd, s.expected_exit) for s in steps] == [(2, "abandoned", "", None),
                                                                        (5, None, "b", 0)]


def test_executor_failure_is_a_divergence_not_a_crash() -> None:
    class Broken:
        def run(self, cmd: str, args: list[str], cwd: str | None, user: str | None, envs: dict[str, str]) -> int:
            raise TimeoutError("sandbox did not answer")

        def write(self, path: str, data: bytes, user: str | None) -> None:
            raise AssertionError("not called")

    events = _events([("process.start", {"pid": 1, "cmd": "x", "args": []}),
                      ("process.exit", {"pid": 1, "exitCode": 0, "status": "exit status 0"})])
    report = Replayer(Broken()).replay(events)
    assert not report.ok and "TimeoutError" in report.divergences[0].detail
