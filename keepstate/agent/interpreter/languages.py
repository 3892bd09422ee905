"""Languages a context can run: names, their Jupyter kernels, and per-language env-var code."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

# The kernel spec each language runs on (installed by keepstate/template/definitions/code-interpreter-v1.toml).
KERNEL_NAMES: dict[str, str] = {
    "python": "python3",
    "javascript": "jslab",
    "typescript": "tslab",
    "bash": "bash",
    "r": "ir",  # IRkernel
    "java": "java",  # the bridge's own JShell kernel (java_kernel.py)
}

# IPython start-up files, run from the bridge's own (bind-mounted) package rather than copied into
# the template, so that they change without a template rebuild.
_STARTUP = Path(__file__).resolve().parent / "startup"
PYTHON_STARTUP = _STARTUP / "00_e2b.py"  # E2B's extra MIME types; every Python context
PYTHON_WARM = _STARTUP / "warm.py"  # background imports; default contexts only

_ALIASES = {"js": "javascript", "ts": "typescript", "sh": "bash", "py": "python", "python3": "python"}

# How the Java kernel's env-var code starts (java_kernel.py acts on it).
JAVA_ENV_MAGIC = "%keepstate_env "

# Names every language can set: bash rejects anything else, and a name is code in every snippet below.
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class LanguageError(ValueError):
    """A language or env-var name the bridge cannot run."""


def normalize(language: str | None) -> str:
    """The canonical language name: lower-cased, trimmed, aliases resolved; None means python."""
    if language is None:
        return "python"
    name = language.strip().lower()
    if not name:
        return "python"
    return _ALIASES.get(name, name)


def kernel_name(language: str) -> str:
    try:
        return KERNEL_NAMES[language]
    except KeyError:
        known = ", ".join(sorted(KERNEL_NAMES))
        raise LanguageError(f"Unsupported language '{language}'; supported: {known}") from None


def kernel_arguments(language: str, default: bool = False) -> list[str]:
    """Arguments added to the kernel spec's command line for a context of `language`.

    `default`: for the language's default context, which most executions use and which starts
    with the sandbox, so warming it up costs nobody a wait.
    """
    if language != "python":
        return []
    files = [PYTHON_STARTUP, PYTHON_WARM] if default else [PYTHON_STARTUP]
    return [f"--IPKernelApp.exec_files={f}" for f in files]


def check_env_names(names: Sequence[str]) -> None:
    bad = [n for n in names if not _ENV_NAME.match(n)]
    if bad:
        raise LanguageError(f"Invalid environment variable name(s): {', '.join(map(repr, bad))}")


def env_code(language: str, set_vars: Mapping[str, str], unset: Sequence[str] = ()) -> str | None:
    """Code that, run silently in a kernel of `language`, sets `set_vars` and removes `unset`.

    Returns None when there is nothing to do. Values are embedded as JSON/shell-quoted literals, so
    arbitrary values are safe; names must pass `check_env_names`.
    """
    check_env_names([*set_vars, *unset])
    if not set_vars and not unset:
        return None
    values = json.dumps(dict(set_vars))
    gone = json.dumps(list(unset))
    if language == "python":
        return (
            "import os as __ks_os\n"
            f"__ks_os.environ.update({values})\n"
            f"for __ks_k in {gone}: __ks_os.environ.pop(__ks_k, None)\n"
            "del __ks_os\n"
        )
    if language in ("javascript", "typescript"):
        return f"Object.assign(process.env, {values}); for (const k of {gone}) {{ delete process.env[k]; }}"
    if language == "bash":
        lines = [f"export {k}={shlex.quote(v)}" for k, v in set_vars.items()]
        lines += [f"unset {k}" for k in unset]
        return "\n".join(lines)
    if language == "r":
        # JSON strings are R string literals too (R reads \\uXXXX escapes; env values hold no NUL).
        code = []
        if set_vars:
            pairs = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in set_vars.items())
            code.append(f"invisible(Sys.setenv({pairs}))")
        if unset:
            code.append(f"invisible(Sys.unsetenv(c({', '.join(map(json.dumps, unset))})))")
        return "\n".join(code)
    if language == "java":
        # Java cannot change its environment; the Java kernel does it for this line (see java_kernel.py).
        return JAVA_ENV_MAGIC + json.dumps({"set": dict(set_vars), "unset": list(unset)})
    raise LanguageError(f"Unsupported language '{language}'")


def restore_plan(
    overrides: Mapping[str, str], sandbox_envs: Mapping[str, str]
) -> tuple[dict[str, str], list[str]]:
    """What to set and unset after an execution so that `overrides` revert to the sandbox-level values."""
    back = {k: sandbox_envs[k] for k in overrides if k in sandbox_envs}
    gone = [k for k in overrides if k not in sandbox_envs]
    return back, gone
