"""A Jupyter kernel for Java: ipykernel's protocol in front of JShell (kernels/JShellRunner.java) in a JVM of its own.

Run by the code-interpreter template's `java` kernel spec as
`python3 -m keepstate.agent.interpreter.java_kernel -f CONNECTION_FILE`, with the bridge's package on PYTHONPATH,
so it changes without a template rebuild. No packaged Java kernel fits: Debian has none, and PyPI's (JJava) talks
ZeroMQ through JeroMQ, whose `ipc://` is TCP underneath, which gVisor checkpoints drop.

A cell is split into JShell snippets and run up to the first failure; what it writes comes back as stream output,
the value of its last snippet, when that is an expression, as the execution's result (jshell's `$1 ==> 42`
gives 42), and a failure as a Jupyter error: the exception's class name, message and Java stack trace, or
`CompilationException` and javac's diagnostics. A line `%keepstate_env {"set": {...}, "unset": [...]}` (the
bridge's env-var code for Java) changes the JVM's own environment, which Java has no API for.
"""

from __future__ import annotations

import base64
import codecs
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ipykernel.kernelbase import Kernel

from keepstate.agent.interpreter.languages import JAVA_ENV_MAGIC as ENV_MAGIC

RUNNER = Path(__file__).resolve().parent / "kernels" / "JShellRunner.java"
# Serial GC and C1 only: a JVM that starts fast and stays small (the sandbox's 1 GiB is shared with other kernels).
# The opens let the runner change the JVM's environment map.
JAVA_OPTIONS = [
    "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xshare:auto",
    "--add-opens=java.base/java.lang=ALL-UNNAMED", "--add-opens=java.base/java.util=ALL-UNNAMED",
]
# Set for this kernel by its spec; not for the JVM, whose children are the user's.
KERNEL_ONLY_ENV = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")


class RunnerGone(RuntimeError):
    """The JVM exited (System.exit in a cell, a crash, or killed)."""


def compiled_runner(source: Path = RUNNER) -> Path:
    """A directory with the runner's classes: compiled once per source version and user, shared by kernels."""
    text = source.read_bytes()
    cache = Path(tempfile.gettempdir()) / f"keepstate-jshell-{os.getuid()}-{hashlib.sha256(text).hexdigest()[:16]}"
    if (cache / "JShellRunner.class").is_file():
        return cache
    work = Path(tempfile.mkdtemp(prefix=cache.name + "."))
    try:
        subprocess.run(["javac", "-nowarn", "-encoding", "UTF-8", "-d", str(work), str(source)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
        try:
            os.rename(work, cache)
        except OSError:  # another kernel compiled it first
            if not (cache / "JShellRunner.class").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return cache


def encode(field: str) -> str:
    return base64.b64encode(field.encode()).decode()


class Runner:
    """One JVM running JShellRunner, and its request and answer pipes."""

    def __init__(self) -> None:
        classes = compiled_runner()
        env = {k: v for k, v in os.environ.items() if k not in KERNEL_ONLY_ENV}
        req_r, req_w = os.pipe()
        ans_r, ans_w = os.pipe()
        try:
            # Its own session: a SIGINT for the kernel's process group is forwarded once, by interrupt(). Its stdout
            # and stderr (the JVM's own messages, children that inherit them) are the kernel's stderr: the bridge log.
            self.proc = subprocess.Popen(
                ["java", *JAVA_OPTIONS, "-cp", str(classes), "JShellRunner", str(req_r), str(ans_w)],
                stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(), env=env, pass_fds=(req_r, ans_w),
                start_new_session=True)
        finally:
            os.close(req_r)
            os.close(ans_w)
        self._requests = os.fdopen(req_w, "w", encoding="ascii", buffering=1)
        self._answers = os.fdopen(ans_r, "rb")
        kind, _ = self.read()
        if kind != "READY":
            raise RunnerGone(f"the JVM answered {kind!r} at start")

    def send(self, kind: str, *fields: str) -> None:
        try:
            self._requests.write(" ".join([kind, *map(encode, fields)]) + "\n")
            self._requests.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise RunnerGone(str(exc)) from None

    def read(self) -> tuple[str, list[bytes]]:
        line = self._answers.readline()
        if not line.endswith(b"\n"):
            raise RunnerGone(f"the JVM exited (status {self.proc.wait()})")
        kind, *fields = line.decode("ascii").rstrip("\n").split(" ")  # an empty field is an empty string
        return kind, [base64.b64decode(f) for f in fields]

    def interrupt(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)

    def close(self) -> None:
        for stream in (self._requests, self._answers):
            try:
                stream.close()
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class JavaKernel(Kernel):  # type: ignore[misc]  # ipykernel ships no types: Kernel is Any
    implementation = "keepstate-java"
    implementation_version = "1.0"
    language = "java"
    language_version = "17"
    language_info = {
        "name": "java", "version": "17", "mimetype": "text/x-java-source", "file_extension": ".java",
        "pygments_lexer": "java", "codemirror_mode": "text/x-java",
    }
    banner = "Java (JShell), a KeepState kernel"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # An interrupt (SIGINT to the kernel's process group) is passed on to the JVM, which stops the running
        # snippet, by a handler of the kernel's own rather than ipykernel's KeyboardInterrupt, which code reading
        # the JVM's answers would have to catch everywhere. Set before the JVM starts: ipykernel ignores SIGINT
        # until then, and a JVM that starts with SIGINT ignored cannot handle it.
        self._runner: Runner | None = None
        signal.signal(signal.SIGINT, self._on_interrupt)
        # Started now: the kernel answers its first kernel_info request once the JVM is ready.
        self._runner = Runner()

    def _on_interrupt(self, signum: int, frame: object) -> None:
        if self._runner is not None:
            self._runner.interrupt()

    def pre_handler_hook(self) -> None:
        """Keeps the kernel's own SIGINT handler (see __init__)."""

    def post_handler_hook(self) -> None:
        """Keeps the kernel's own SIGINT handler (see __init__)."""

    def _request(self, kind: str, *fields: str) -> Iterator[tuple[str, list[bytes]]]:
        """The answers to one request, up to its DONE."""
        if self._runner is None:
            self._runner = Runner()  # the last JVM exited: a fresh one, without the old one's state
        runner = self._runner
        runner.send(kind, *fields)
        while True:
            try:
                kind, answer = runner.read()
            except RunnerGone:
                runner.close()
                self._runner = None
                raise
            if kind == "DONE":
                return
            yield kind, answer

    def do_execute(self, code: str, silent: bool, store_history: bool = True,
                   user_expressions: dict[str, Any] | None = None, allow_stdin: bool = False,
                   **kwargs: Any) -> dict[str, Any]:
        error: tuple[str, str, str] | None = None
        decoders = {"OUT": codecs.getincrementaldecoder("utf-8")("replace"),
                    "ERR": codecs.getincrementaldecoder("utf-8")("replace")}
        try:
            for kind, fields in self._answers(code):
                if kind in decoders:
                    self._stream(kind, decoders[kind].decode(fields[0]), silent)
                elif kind == "RESULT" and not silent:
                    self.send_response(self.iopub_socket, "execute_result", {
                        "execution_count": self.execution_count, "data": {"text/plain": fields[0].decode()},
                        "metadata": {}})
                elif kind == "ERROR" and error is None:
                    name, value, trace = (f.decode() for f in fields)
                    error = (name, value, trace)
        except RunnerGone as exc:
            error = ("EngineTerminated", f"{exc}; the next execution starts a new JVM, without this one's state", "")
        for kind, decoder in decoders.items():
            self._stream(kind, decoder.decode(b"", final=True), silent)
        if error is None:
            return {"status": "ok", "execution_count": self.execution_count, "payload": [], "user_expressions": {}}
        name, value, trace = error
        content = {"ename": name, "evalue": value, "traceback": trace.splitlines() or [f"{name}: {value}"]}
        if not silent:
            self.send_response(self.iopub_socket, "error", content)
        return {"status": "error", "execution_count": self.execution_count, **content}

    def _answers(self, code: str) -> Iterator[tuple[str, list[bytes]]]:
        if code.startswith(ENV_MAGIC):
            change = json.loads(code[len(ENV_MAGIC):])
            for name, value in change.get("set", {}).items():
                yield from self._request("SETENV", name, value)
            for name in change.get("unset", []):
                yield from self._request("UNSETENV", name)
            return
        yield from self._request("EVAL", code)

    def _stream(self, kind: str, text: str, silent: bool) -> None:
        # As E2B's Java kernel: a printed line comes without its newline (`println("hi")` is ["hi"]).
        text = text[:-1] if text.endswith("\n") else text
        if text and not silent:
            self.send_response(self.iopub_socket, "stream",
                               {"name": "stdout" if kind == "OUT" else "stderr", "text": text})

    def do_shutdown(self, restart: bool) -> dict[str, Any]:
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        return {"status": "ok", "restart": restart}


def main() -> None:
    from ipykernel.kernelapp import IPKernelApp

    IPKernelApp.launch_instance(kernel_class=JavaKernel)


if __name__ == "__main__":
    main()
