"""Language names and env-var code (keepstate.agent.interpreter.languages)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from keepstate.agent.interpreter import languages


def test_normalize() -> None:
    assert languages.normalize(None) == "python"
    assert languages.normalize(" JS ") == "javascript"
    assert languages.normalize("ts") == "typescript"
    assert languages.normalize("Bash") == "bash"


def test_unknown_language() -> None:
    with pytest.raises(languages.LanguageError, match="cobol"):
        languages.kernel_name("cobol")


def test_env_names_are_checked() -> None:
    with pytest.raises(languages.LanguageError):
        languages.env_code("bash", {"A; rm -rf /": "x"})


def test_python_env_code_runs() -> None:
    code = languages.env_code("python", {"KS_A": "it's \"quoted\"\n"}, ["KS_GONE"])
    assert code is not None
    probe = code + "import os; print(repr(os.environ['KS_A']), 'KS_GONE' in os.environ)"
    env = {**os.environ, "KS_GONE": "1"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == repr("it's \"quoted\"\n") + " False"


def test_bash_env_code_runs() -> None:
    code = languages.env_code("bash", {"KS_A": "a'b $HOME"}, ["KS_GONE"])
    out = subprocess.run(["bash", "-c", f"{code}\necho \"$KS_A|${{KS_GONE-none}}\""],
                         env={**os.environ, "KS_GONE": "1"}, capture_output=True, text=True, check=True)
    assert out.stdout == "a'b $HOME|none\n"


def test_restore_plan() -> None:
    back, gone = languages.restore_plan({"A": "x", "B": "y"}, {"A": "orig"})
    assert back == {"A": "orig"} and gone == ["B"]
    assert languages.env_code("python", {}, []) is None


def test_kernel_arguments() -> None:
    lean = languages.kernel_arguments("python")
    warm = languages.kernel_arguments("python", default=True)
    assert lean == [f"--IPKernelApp.exec_files={languages.PYTHON_STARTUP}"]
    assert warm == lean + [f"--IPKernelApp.exec_files={languages.PYTHON_WARM}"]
    assert languages.PYTHON_STARTUP.is_file() and languages.PYTHON_WARM.is_file()
    assert languages.kernel_arguments("javascript", default=True) == []


def test_startup_files_compile() -> None:
    # They run inside kernels only; a syntax error would surface as a kernel that lost its formatters.
    for path in (languages.PYTHON_STARTUP, languages.PYTHON_WARM):
        compile(path.read_text(), str(path), "exec")


def test_every_language_of_e2b_has_a_kernel() -> None:
    assert set(languages.KERNEL_NAMES) == {"python", "javascript", "typescript", "bash", "r", "java"}
    assert languages.kernel_name(languages.normalize("R")) == "ir"
    assert languages.kernel_name("java") == "java"
    assert languages.kernel_arguments("r", default=True) == [] and languages.kernel_arguments("java") == []


def test_r_env_code() -> None:
    # R is not on the host: the code itself (run in sandboxes by test_contexts_envs.test_r).
    code = languages.env_code("r", {"KS_A": 'it\'s "q"\n', "_B": "é"}, ["KS_GONE"])
    assert code == ('invisible(Sys.setenv("KS_A" = "it\'s \\"q\\"\\n", "_B" = "\\u00e9"))\n'
                    'invisible(Sys.unsetenv(c("KS_GONE")))')
    assert languages.env_code("r", {}, ["X"]) == 'invisible(Sys.unsetenv(c("X")))'


def test_java_env_code_is_the_java_kernels_directive() -> None:
    code = languages.env_code("java", {"KS_A": "a b"}, ["KS_GONE"])
    assert code is not None and code.startswith(languages.JAVA_ENV_MAGIC)
    assert json.loads(code[len(languages.JAVA_ENV_MAGIC):]) == {"set": {"KS_A": "a b"}, "unset": ["KS_GONE"]}
