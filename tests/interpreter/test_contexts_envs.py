"""Contexts, env vars, languages (bash, JavaScript/TypeScript, R, Java), access token."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from e2b import NotFoundException, SandboxException
from e2b_code_interpreter import Sandbox

from keepstate.ports import INTERPRETER_PORT
from tests.interpreter.conftest import HOME


def test_default_contexts(new_sandbox: Callable[..., Sandbox]) -> None:
    sbx = new_sandbox()
    # Python's default context starts with the sandbox; JavaScript's is listed from the start too (as E2B's), its
    # kernel started on first use; other languages' on their first use.
    assert [c.language for c in sbx.list_code_contexts()] == ["python", "javascript"]
    sbx.run_code("const jsDefault = 1", language="js")
    assert sbx.run_code("jsDefault + 1", language="javascript").text == "2"
    contexts = sbx.list_code_contexts()
    assert [c.language for c in contexts] == ["python", "javascript"]
    assert all(c.cwd == HOME for c in contexts)


def test_list_has_a_default_context_per_used_language(new_sandbox: Callable[..., Sandbox]) -> None:
    sbx = new_sandbox()
    used = {"bash": "echo hi", "r": "1", "java": "1", "typescript": "1"}
    for language, code in used.items():
        assert sbx.run_code(code, language=language, timeout=240).error is None
        assert sbx.run_code(code, language=language).error is None  # the same default context again
    contexts = sbx.list_code_contexts()
    assert sorted(c.language for c in contexts) == sorted(["python", "javascript", *used])
    assert all(c.cwd == HOME for c in contexts)
    ctx = sbx.create_code_context(language="r")  # a context made on request is listed too, beside the default
    assert [c.id for c in sbx.list_code_contexts() if c.language == "r"][-1] == ctx.id


def test_create_list_restart_remove(sandbox: Sandbox) -> None:
    ctx = sandbox.create_code_context(cwd="/tmp")
    assert ctx.language == "python" and ctx.cwd == "/tmp"
    assert ctx.id in [c.id for c in sandbox.list_code_contexts()]
    assert sandbox.run_code("import os; os.getcwd()", context=ctx).text == "/tmp"

    sandbox.run_code("v = 1", context=ctx)
    sandbox.run_code("v = 2")  # the default context is another kernel
    assert sandbox.run_code("v", context=ctx).text == "1"

    sandbox.restart_code_context(ctx)
    assert sandbox.run_code("v", context=ctx).error.name == "NameError"
    assert sandbox.run_code("v").text == "2"

    sandbox.remove_code_context(ctx.id)
    assert ctx.id not in [c.id for c in sandbox.list_code_contexts()]
    with pytest.raises(NotFoundException):
        sandbox.run_code("1", context=ctx)
    with pytest.raises(NotFoundException):
        sandbox.remove_code_context(ctx.id)


def test_env_vars_apply_for_one_execution(sandbox: Sandbox) -> None:
    code = "import os; os.environ.get('KS_VAR', 'unset')"
    assert sandbox.run_code(code, envs={"KS_VAR": "temp"}).text == "temp"
    assert sandbox.run_code(code).text == "unset"


def test_sandbox_env_vars_restored_after_override(new_sandbox: Callable[..., Sandbox]) -> None:
    sbx = new_sandbox(envs={"KS_SBX": "sandbox"})
    code = "import os; os.environ.get('KS_SBX')"
    assert sbx.run_code(code).text == "sandbox"
    assert sbx.run_code(code, envs={"KS_SBX": "override"}).text == "override"
    assert sbx.run_code(code).text == "sandbox"
    assert sbx.run_code("echo $KS_SBX", language="bash").logs.stdout == ["sandbox\n"]
    for language, code in [("r", "cat(Sys.getenv('KS_SBX'))"), ("java", 'System.out.print(System.getenv("KS_SBX"))')]:
        assert sbx.run_code(code, language=language, timeout=240).logs.stdout == ["sandbox"], language
        assert sbx.run_code(code, language=language, envs={"KS_SBX": "o"}).logs.stdout == ["o"], language
        assert sbx.run_code(code, language=language).logs.stdout == ["sandbox"], language


def test_bash(sandbox: Sandbox) -> None:
    execution = sandbox.run_code("X=5; echo $((X * 2)); pwd", language="bash")
    assert execution.logs.stdout == ["10\n", f"{HOME}\n"] or "".join(execution.logs.stdout) == f"10\n{HOME}\n"
    assert sandbox.run_code("echo $X", language="bash").logs.stdout == ["5\n"]
    assert sandbox.run_code("echo $KS_B", language="bash", envs={"KS_B": "it's"}).logs.stdout == ["it's\n"]
    assert sandbox.run_code("echo \"[$KS_B]\"", language="bash").logs.stdout == ["[]\n"]
    failed = sandbox.run_code("exit_status_test() { return 3; }; exit_status_test", language="bash")
    assert failed.error is not None and failed.error.value == "3"


def test_javascript(sandbox: Sandbox) -> None:
    execution = sandbox.run_code("const a = 20; console.log('hi'); a + 1", language="js")
    # The last expression is the execution's result, as with E2B's kernel; what the cell printed stays output.
    assert execution.logs.stdout == ["hi\n"]
    assert execution.text == "21" and [r.is_main_result for r in execution.results] == [True]
    assert sandbox.run_code("await Promise.resolve(a * 2)", language="javascript").text == "40"  # top-level await
    assert sandbox.run_code("({ b: [1, 'x'] })", language="js").text == "{ b: [ 1, 'x' ] }"
    quiet = sandbox.run_code("let nothing = 1", language="js")
    assert quiet.results == [] and quiet.logs.stdout == []
    failed = sandbox.run_code("throw new TypeError('boom')", language="js")
    assert failed.error is not None
    assert (failed.error.name, failed.error.value) == ("TypeError", "boom")
    # Right after an error tslab refuses requests for 200 ms; the bridge retries them.
    assert sandbox.run_code("process.env.KS_JS", language="js", envs={"KS_JS": "j"}).text == "j"
    typed = sandbox.run_code("const n: number = 4; n * n", language="ts")
    assert typed.text == "16" and typed.logs.stdout == []


def test_r(sandbox: Sandbox) -> None:
    execution = sandbox.run_code("x <- 20\nprint('hi')\nx + 1", language="r", timeout=240)
    # A cell's last visible value is its result; print() is output.
    assert execution.logs.stdout == ['[1] "hi"\n']
    assert execution.text == "[1] 21" and [r.is_main_result for r in execution.results] == [True]
    both = sandbox.run_code("x\nx * 2", language="R")  # every visible value is shown; the last is the result
    assert [(r.text, r.is_main_result) for r in both.results] == [("[1] 20", False), ("[1] 40", True)]
    assert sandbox.run_code("y <- 1", language="r").results == []
    # IRkernel sends messages (and warnings) as stderr, with a newline of its own added.
    assert "".join(sandbox.run_code("message('to err')", language="r").logs.stderr).strip() == "to err"
    failed = sandbox.run_code("stop('boom')", language="r")
    assert failed.error is not None and failed.error.name == "ERROR" and "boom" in failed.error.value
    assert "boom" in failed.error.traceback
    assert sandbox.run_code("x", language="r").text == "[1] 20"  # state kept after an error
    assert sandbox.run_code("getwd()", language="r").text == f'[1] "{HOME}"'
    assert sandbox.run_code("Sys.getenv('USER')", language="r").text == '[1] "user"'
    value = "it's \"q\" é $HOME"
    assert sandbox.run_code("cat(Sys.getenv('KS_R'))", language="r", envs={"KS_R": value}).logs.stdout == [value]
    assert sandbox.run_code("Sys.getenv('KS_R', 'unset')", language="r").text == '[1] "unset"'
    ctx = sandbox.create_code_context(language="r", cwd="/tmp")
    try:
        assert ctx.language == "r" and ctx.cwd == "/tmp"
        assert sandbox.run_code("getwd()", context=ctx).text == '[1] "/tmp"'
        assert sandbox.run_code("exists('x')", context=ctx).text == "[1] FALSE"  # another kernel
        assert sandbox.run_code("1", context=ctx).execution_count == 3
    finally:
        sandbox.remove_code_context(ctx)


def test_r_plot_is_an_image(sandbox: Sandbox) -> None:
    execution = sandbox.run_code("plot(1:10)", language="r", timeout=240)
    assert execution.error is None, execution.error
    assert [r for r in execution.results if r.png], execution.results


def test_java(sandbox: Sandbox) -> None:
    execution = sandbox.run_code('int a = 20;\nSystem.out.println("hi");\na + 1', language="java", timeout=240)
    # jshell shows the last expression as `$1 ==> 21`: its value is the execution's result.
    assert execution.logs.stdout == ["hi"]  # as E2B's Java kernel: a printed line without its newline
    assert execution.text == "21" and [r.is_main_result for r in execution.results] == [True]
    assert sandbox.run_code("int b = 2;", language="java").results == []
    assert sandbox.run_code('"it\'s \\"q\\""', language="java").text == "it's \"q\""
    assert sandbox.run_code("List.of(a, 2)", language="java").text == "[20, 2]"  # jshell's default imports
    assert sandbox.run_code('System.err.print("e")', language="java").logs.stderr == ["e"]
    method = sandbox.run_code("int twice(int n) { return 2 * n; }\ntwice(a)", language="java")
    assert method.text == "40"
    failed = sandbox.run_code("int z = 1 / 0;", language="java")
    assert failed.error is not None
    assert (failed.error.name, failed.error.value) == ("java.lang.ArithmeticException", "/ by zero")
    assert "java.lang.ArithmeticException: / by zero" in failed.error.traceback
    bad = sandbox.run_code("int c = ;", language="java")
    assert bad.error is not None and bad.error.name == "CompilationException"
    assert "illegal start of expression" in bad.error.value and "int c = ;" in bad.error.traceback
    thrown = sandbox.run_code('throw new IllegalStateException("boom")', language="java")
    assert thrown.error is not None
    assert (thrown.error.name, thrown.error.value) == ("java.lang.IllegalStateException", "boom")
    assert sandbox.run_code("a", language="java").text == "20"  # state kept after errors
    assert sandbox.run_code('System.getProperty("user.dir")', language="java").text == HOME
    assert sandbox.run_code('System.getProperty("user.name")', language="java").text == "user"
    value = "it's \"q\" é $HOME"
    with_env = sandbox.run_code('System.getenv("KS_J")', language="java", envs={"KS_J": value})
    assert with_env.text == value
    assert sandbox.run_code('System.getenv().getOrDefault("KS_J", "unset")', language="java").text == "unset"
    ctx = sandbox.create_code_context(language="java", cwd="/tmp")
    try:
        assert ctx.language == "java" and ctx.cwd == "/tmp"
        assert sandbox.run_code('System.getProperty("user.dir")', context=ctx).text == "/tmp"
        assert sandbox.run_code("a", context=ctx).error.name == "CompilationException"  # another kernel
        assert sandbox.run_code("1", context=ctx).execution_count == 3
    finally:
        sandbox.remove_code_context(ctx)


def test_unsupported_language(sandbox: Sandbox) -> None:
    with pytest.raises(SandboxException, match="400"):
        sandbox.run_code("1", language="cobol")


@pytest.mark.parametrize("token", ["not-the-token", None])
def test_wrong_access_token_is_rejected(sandbox: Sandbox, token: str | None) -> None:
    headers = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": str(INTERPRETER_PORT)}
    if token:
        headers["X-Access-Token"] = token
    body = {"code": "1", "context_id": None, "language": None, "env_vars": None}
    resp = httpx.post(f"{sandbox._jupyter_url}/execute", json=body, headers=headers, timeout=30)
    assert resp.status_code == 401
