"""Contexts: named kernels the SDK runs code in, and the executions running in them.

Each language has a default context, created on first use (python at start-up). Python's and JavaScript's are
listed from the start, as E2B's are; JavaScript's kernel starts on its first use all the same (LISTED).
Executions in one context run one at a time, in arrival order. An execution runs in its own task
so that what must happen after the user's code (reverting per-execution env vars) still happens
when the client has gone away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from keepstate.agent.interpreter import languages
from keepstate.agent.interpreter.kernel import Kernel, KernelError, LaunchSpec
from keepstate.agent.interpreter.output import END, Line, error_line

log = logging.getLogger(__name__)
LISTED = ("python", "javascript")  # default contexts listed before their first use (E2B's list_contexts shows them)


class ContextNotFound(KeyError):
    def __init__(self, context_id: str) -> None:
        super().__init__(context_id)
        self.message = f"Context {context_id} not found"


@dataclass(eq=False)
class Context:
    id: str
    language: str
    cwd: str
    kernel: Kernel
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Whether the sandbox-level env vars have been pushed into this kernel since it (re)started.
    sandbox_envs_applied: bool = False
    starting: asyncio.Task[None] | None = None  # the kernel's start; None for a listed default not used yet

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    async def ready(self) -> None:
        """The kernel has started: a listed default's starts now (once, whoever asks; again after a failure)."""
        if self.starting is not None and self.starting.done() and (
                self.starting.cancelled() or self.starting.exception() is not None):
            self.starting = None
        if self.starting is None:
            self.starting = asyncio.create_task(self.kernel.start(), name=f"kernel-start-{self.id}")
        await asyncio.shield(self.starting)


class Execution:
    """One user execution. Read `lines` until it yields `END`; call `abandon()` if the reader leaves."""

    def __init__(self, ctx: Context, code: str, env_vars: Mapping[str, str],
                 sandbox_envs: Mapping[str, str], inherited: Mapping[str, str]) -> None:
        self.ctx = ctx
        # Sandbox-level vars the kernel did not inherit from the bridge's own environment. Usually
        # none: pushing them costs an execution, which some kernels (tslab) count. Java's kernel gets them all:
        # it makes each a system property too (E2B's Java users read System.getProperty).
        self._missing_envs = {k: v for k, v in sandbox_envs.items()
                              if inherited.get(k) != v or ctx.language == "java"}
        self.lines: asyncio.Queue[Line] = asyncio.Queue()
        self._code = code
        self._env_vars = dict(env_vars)
        self._sandbox_envs = dict(sandbox_envs)
        self._abandoned = False
        self._user_code_running = False
        self.task = asyncio.create_task(self._run(), name=f"execution-{ctx.id}")

    async def abandon(self) -> None:
        """The client is gone: skip the code if it has not started, interrupt it if it has."""
        self._abandoned = True
        if self._user_code_running:
            try:
                await self.ctx.kernel.interrupt()
            except Exception:
                log.warning("interrupting context %s failed", self.ctx.id, exc_info=True)

    async def _silent(self, code: str | None) -> None:
        if code is not None:
            async for _ in self.ctx.kernel.execute(code, silent=True):
                pass

    async def _run(self) -> None:
        ctx = self.ctx
        try:
            async with ctx.lock:
                if self._abandoned:
                    return
                try:
                    await ctx.ready()
                    if not ctx.sandbox_envs_applied:
                        await self._silent(languages.env_code(ctx.language, self._missing_envs))
                        ctx.sandbox_envs_applied = True
                    await self._silent(languages.env_code(ctx.language, self._env_vars))
                    self._user_code_running = True
                    async for line in ctx.kernel.execute(self._code):
                        self.lines.put_nowait(line)
                except KernelError as exc:
                    self.lines.put_nowait(error_line("KernelError", str(exc), []))
                finally:
                    self._user_code_running = False
                    if self._env_vars:
                        back, gone = languages.restore_plan(self._env_vars, self._sandbox_envs)
                        try:
                            await self._silent(languages.env_code(ctx.language, back, gone))
                        except KernelError:
                            log.warning("could not revert env vars in context %s", ctx.id)
        except Exception as exc:  # never leave a reader waiting on a line that will not come
            log.exception("execution in context %s failed", ctx.id)
            self.lines.put_nowait(error_line(type(exc).__name__, str(exc), []))
        finally:
            self.lines.put_nowait(END)


class Contexts:
    def __init__(self, spec: LaunchSpec, available: Mapping[str, str]) -> None:
        """`available`: language → kernel name, for the kernels installed here."""
        self._spec = spec
        self._available = dict(available)
        self._contexts: dict[str, Context] = {}
        self._defaults: dict[str, asyncio.Task[Context]] = {}
        self._listed: dict[str, Context] = {}  # default contexts listed, their kernels not started yet

    @property
    def languages(self) -> list[str]:
        return sorted(self._available)

    def _kernel_for(self, language: str) -> str:
        languages.kernel_name(language)  # raises for languages no template could run
        if language not in self._available:
            raise languages.LanguageError(
                f"Language '{language}' is not available in this sandbox (no kernel installed for it)")
        return self._available[language]

    def _new(self, language: str | None, cwd: str | None, default: bool) -> Context:
        lang = languages.normalize(language)
        kernel = Kernel(self._kernel_for(lang), self._with_cwd(cwd), languages.kernel_arguments(lang, default))
        return Context(id=str(uuid.uuid4()), language=lang, cwd=cwd or self._spec.cwd, kernel=kernel)

    async def create(self, language: str | None = None, cwd: str | None = None, *,
                     default: bool = False) -> Context:
        ctx = self._new(language, cwd, default)
        await ctx.ready()
        self._contexts[ctx.id] = ctx
        return ctx

    def _with_cwd(self, cwd: str | None) -> LaunchSpec:
        if not cwd:
            return self._spec
        return LaunchSpec(runtime_dir=self._spec.runtime_dir, cwd=cwd, user=self._spec.user, env=self._spec.env)

    async def default(self, language: str | None) -> Context:
        """The language's default context, created (once, even under concurrent calls) on first use."""
        lang = languages.normalize(language)
        self._kernel_for(lang)
        listed = self._listed.get(lang)
        if listed is not None and listed.id in self._contexts:
            await listed.ready()
            return listed
        task = self._defaults.get(lang)
        if task is not None and task.done() and (task.cancelled() or task.exception() is not None
                                                 or task.result().id not in self._contexts):
            task = None  # failed or removed: make a new one
        if task is None:
            task = asyncio.create_task(self.create(lang, default=True), name=f"default-{lang}")
            self._defaults[lang] = task
        return await asyncio.shield(task)

    def start_defaults(self, langs: list[str]) -> None:
        """Start `langs`' default contexts now; list those of LISTED too, to start on their first use. Listed in
        LISTED's order, then `langs`' (`contexts[-1]` is then the context a user made last, as with E2B)."""
        for lang in [*LISTED, *(lang for lang in langs if lang not in LISTED)]:
            if lang not in self._available:
                continue
            ctx = self._new(lang, None, default=True)
            self._contexts[ctx.id] = ctx
            if lang in langs:
                self._defaults[lang] = asyncio.create_task(self._start_default(ctx), name=f"default-{lang}")
            else:
                self._listed[lang] = ctx

    async def _start_default(self, ctx: Context) -> Context:
        try:
            await ctx.ready()
        except BaseException:
            self._contexts.pop(ctx.id, None)  # a default that failed is not listed; the next use makes another
            raise
        return ctx

    async def wait_defaults(self) -> list[str]:
        """Once the default contexts being started have started or failed: the languages that started."""
        tasks = dict(self._defaults)
        if tasks:
            await asyncio.wait([asyncio.shield(t) for t in tasks.values()])
        return sorted(lang for lang, t in tasks.items() if not t.cancelled() and t.exception() is None)

    def get(self, context_id: str) -> Context:
        try:
            return self._contexts[context_id]
        except KeyError:
            raise ContextNotFound(context_id) from None

    async def list(self) -> list[Context]:
        """All contexts, once the default contexts still starting have started (or failed)."""
        pending = [t for t in self._defaults.values() if not t.done()]
        if pending:
            await asyncio.wait([asyncio.shield(t) for t in pending])
        return list(self._contexts.values())

    async def restart(self, context_id: str) -> None:
        ctx = self.get(context_id)
        never_started = ctx.starting is None  # a listed default never used: starting it is restarting it
        await ctx.ready()
        if not never_started:
            await ctx.kernel.restart()
        ctx.sandbox_envs_applied = False

    async def remove(self, context_id: str) -> None:
        ctx = self._contexts.pop(context_id, None)
        if ctx is None:
            raise ContextNotFound(context_id)
        if ctx.starting is not None:
            with contextlib.suppress(Exception):
                await ctx.ready()  # a start under way ends before the kernel is stopped
        await ctx.kernel.shutdown()

    def run(self, ctx: Context, code: str, env_vars: Mapping[str, str],
            sandbox_envs: Mapping[str, str]) -> Execution:
        languages.check_env_names(list(env_vars))
        return Execution(ctx, code, env_vars, sandbox_envs, self._spec.env)

    async def close(self) -> None:
        for task in self._defaults.values():
            if not task.done():
                task.cancel()
        results: list[Any] = await asyncio.gather(*self._defaults.values(), return_exceptions=True)
        del results
        for ctx in list(self._contexts.values()):
            if ctx.starting is not None and not ctx.starting.done():
                ctx.starting.cancel()
                with contextlib.suppress(BaseException):
                    await ctx.starting
            await ctx.kernel.shutdown()
        self._contexts.clear()
