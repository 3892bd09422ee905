"""Kernels are part of a sandbox's checkpoint: state survives pause/resume, and forks diverge."""

from __future__ import annotations

from collections.abc import Callable

from e2b_code_interpreter import Sandbox


def test_pause_resume_then_fork_into_three(new_sandbox: Callable[..., Sandbox]) -> None:
    sbx = new_sandbox()
    sbx.run_code("import pandas as pd\nkept = 41\nframe = pd.DataFrame({'a': [1, 2]})")
    js = sbx.create_code_context(language="js")
    sbx.run_code("const jsKept = 'yes'", context=js)

    sbx.pause()
    resumed = Sandbox.connect(sbx.sandbox_id)
    assert resumed.run_code("kept + 1").text == "42"
    assert resumed.run_code("jsKept", context=js).text == "yes"

    forks = resumed.fork(count=3)
    try:
        assert all(isinstance(f, Sandbox) for f in forks), forks
        for i, fork in enumerate(forks):
            execution = fork.run_code(f"kept += {i}\nint(frame['a'].sum()) + kept")  # type: ignore[union-attr]
            assert execution.error is None, execution.error
            assert execution.text == str(3 + 41 + i)
        # Each copy diverged on its own; the original kept its value.
        assert [f.run_code("kept").text for f in forks] == ["41", "42", "43"]  # type: ignore[union-attr]
        assert resumed.run_code("kept").text == "41"
    finally:
        for fork in forks:
            if isinstance(fork, Sandbox):
                fork.kill()
