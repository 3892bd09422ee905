"""run_code through the stock SDK: results, logs, callbacks, errors, counts, cwd."""

from __future__ import annotations

from e2b_code_interpreter import Sandbox

from tests.interpreter.conftest import HOME


def test_result_and_state(sandbox: Sandbox) -> None:
    sandbox.run_code("x = 41")
    execution = sandbox.run_code("x + 1")
    assert execution.text == "42"
    assert execution.error is None
    assert execution.results[0].is_main_result


def test_string_result_is_unquoted(sandbox: Sandbox) -> None:
    assert sandbox.run_code("'hello'").text == "hello"


def test_stdout_stderr_callbacks(sandbox: Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    execution = sandbox.run_code(
        "import sys\nprint('to out')\nprint('to err', file=sys.stderr)",
        on_stdout=lambda m: out.append(m.line),
        on_stderr=lambda m: err.append(m.line),
    )
    assert "".join(out) == "to out\n"
    assert "".join(err) == "to err\n"
    assert execution.logs.stdout == out
    assert execution.logs.stderr == err


def test_error(sandbox: Sandbox) -> None:
    errors = []
    execution = sandbox.run_code("undefined_name", on_error=errors.append)
    assert execution.error is not None
    assert execution.error.name == "NameError"
    assert "undefined_name" in execution.error.value
    assert "NameError" in execution.error.traceback
    assert errors == [execution.error]


def test_execution_count_counts_user_executions_only(sandbox: Sandbox) -> None:
    ctx = sandbox.create_code_context()
    try:
        # env_vars make the bridge run silent set-up code around the user's: that must not count.
        assert sandbox.run_code("1", envs={"A": "1"}, context=ctx).execution_count == 1
        assert sandbox.run_code("2", context=ctx).execution_count == 2
    finally:
        sandbox.remove_code_context(ctx)


def test_cwd_and_user(sandbox: Sandbox) -> None:
    assert sandbox.run_code("import os; os.getcwd()").text == HOME
    assert sandbox.run_code("import getpass; getpass.getuser()").text == "user"


def test_no_result_for_statement(sandbox: Sandbox) -> None:
    execution = sandbox.run_code("y = 3")
    assert execution.results == []
    assert execution.text is None
