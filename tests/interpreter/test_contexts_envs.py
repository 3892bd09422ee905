"""Contexts, env vars, languages (bash, JavaScript), access token."""

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
    # Python's default context starts with the sandbox; other languages' on their first use.
    assert [c.language for c in sbx.list_code_contexts()] == ["python"]
    sbx.run_code("const jsDefault = 1", language="js")
    assert sbx.run_code("jsDefault + 1", language="javascript").text == "2"
    contexts = sbx.list_code_contexts()
    assert sorted(c.language for c in contexts) == ["javascript", "python"]
    assert all(c.cwd == HOME for c in contexts)


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
