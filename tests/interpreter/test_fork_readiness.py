"""Fork readiness under load (docs/design/sandbox-lifecycle.md, "Fork readiness"): a fork of a code-interpreter
sandbox is handed out only once its bridge (port 49999) accepts again, so every child answers `run_code` at its
first call, with the host's two cores kept busy. Issue: the third of three forks answered 502 "port is not
open" now and then."""

from __future__ import annotations

from collections.abc import Callable

from e2b_code_interpreter import Sandbox

from tests.sdk.sdkharness import BusyCores

ROUNDS, CHILDREN = 8, 3


def test_every_fork_answers_run_code_at_once_under_load(new_sandbox: Callable[..., Sandbox]) -> None:
    sbx = new_sandbox()
    sbx.run_code("kept = 41")
    js = sbx.create_code_context(language="js")
    sbx.run_code("const jsKept = 'yes'", context=js)
    failures = []
    with BusyCores(2):
        for r in range(ROUNDS):
            # A call just before the fork, as a user's would be: its keep-alive connection into the bridge is
            # closed by the fork's quiesce, and the bridge must have answered that close before the capture.
            assert sbx.run_code("kept").text == "41"
            forks = sbx.fork(count=CHILDREN)
            try:
                for i, child in enumerate(forks):
                    try:
                        text = child.run_code(f"kept + {i}").text  # the first call, no waiting
                    except Exception as exc:  # noqa: BLE001 - collected, asserted below
                        failures.append(f"round {r} child {i} ({child.sandbox_id}): {exc!r}")
                        continue
                    if text != str(41 + i):
                        failures.append(f"round {r} child {i}: {text!r}")
            finally:
                for child in forks:
                    child.kill()
    assert not failures, failures
    assert sbx.run_code("jsKept", context=js).text == "yes"  # the parent ran on through every fork
