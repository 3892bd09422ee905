"""The template builder of E2B's protocol: a build sandbox, its steps, a snapshot (docs/design/template-builds.md).

A build is a sandbox created through the manager like a user's (so admission and limits hold), from the parent
template or from the step cache's layer; the steps run in it through its agent; a snapshot of it, once its start
command is ready, is the template. Only `publish` makes a build visible by name, in one database transaction
(keepstate.db.repos.Templates), so a failed build leaves nothing half-published; the checkpoints it took are deleted
from the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import shlex
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from keepstate.clock import rfc3339
from keepstate.db.engine import Database
from keepstate.db.records import BuildRecord, LayerRecord, TemplateRecord
from keepstate.db.repos import Templates
from keepstate.errors import BadRequest, Conflict, KeepStateError, NotFound, Unsupported
from keepstate.sandbox.agent_exec import TAIL_LINES
from keepstate.sandbox.agent_exec import Result as CommandResult
from keepstate.sandbox.manager import SandboxManager
from keepstate.sandbox.record import SandboxRow, Snapshot

from .steps import (
    BASE_IMAGE,
    DEFAULT_READY_TIMEOUT,
    BuildSpec,
    State,
    Step,
    archive_hash,
    chain,
    has_directories,
    parent_key,
)
from .uploads import Uploads

log = logging.getLogger("keepstate.template")

LAYER_PREFIX = "template-layer-"  # a layer is a create's templateID for the build sandbox of a cached build
BUILD_TIMEOUT = 3600
NAME_RE = re.compile(r"\A[a-z0-9][a-z0-9._/-]{0,127}\Z")
TAG_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
DEFAULT_TAG = "default"
STORE_LABEL = "keepstate.template"  # the template snapshot's metadata key: how another server finds it in the store
MISS_TTL = 5.0  # a name the store was searched for in vain is not searched again for this long


class StepFailed(Exception):
    def __init__(self, step: str, message: str) -> None:
        super().__init__(message)
        self.step = step
        self.message = message


@dataclass
class BuildLog:
    entries: list[dict[str, Any]] = field(default_factory=list)

    def add(self, message: str, level: str = "info", step: str | None = None) -> None:
        entry: dict[str, Any] = {"timestamp": rfc3339(time.time()), "level": level, "message": message}
        if step is not None:
            entry["step"] = step
        self.entries.append(entry)


def split_ref(ref: str) -> tuple[str, str]:
    """`name:tag` → (name, tag); no tag → the default one."""
    name, _, tag = ref.partition(":")
    return name, tag or DEFAULT_TAG


def new_template_id() -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(20))


def _glob_quote(src: str) -> str:
    """A shell word for `src` that keeps only its glob characters active."""
    return "".join(c if c in "*?[]" else shlex.quote(c) for c in src) if any(c in src for c in "*?[") \
        else shlex.quote(src)


def copy_script(archive: str, src: str, dest: str, owner: str, mode: str, workdir: str) -> str:
    """Extract an upload and copy its `src` to `dest` with Docker's COPY rules, as root; then owner and mode.
    Plain POSIX shell and coreutils/busybox: no Python in the image is needed."""
    return f"""set -e
a={shlex.quote(archive)}; d=$(mktemp -d); list=$(mktemp)
tar -xf "$a" -C "$d"
dest={shlex.quote(dest)}
case "$dest" in /*) ;; *) dest={shlex.quote(workdir.rstrip('/'))}/"$dest" ;; esac
into=0; case {shlex.quote(dest)} in */) into=1 ;; esac
cd "$d"
count=0; for p in {_glob_quote(src)}; do count=$((count+1)); done
[ "$count" -gt 1 ] && into=1
for p in {_glob_quote(src)}; do
  [ -e "$p" ] || [ -L "$p" ] || {{ echo "COPY: nothing in the upload matches {src}" >&2; exit 1; }}
  if [ -d "$p" ] && [ ! -L "$p" ]; then
    [ -e "$dest" ] || {{ mkdir -p "$dest"; echo "$dest" >> "$list"; }}
    for c in "$p"/* "$p"/.[!.]* "$p"/..?*; do
      [ -e "$c" ] || [ -L "$c" ] || continue
      cp -a "$c" "$dest/"; echo "$dest/$(basename "$c")" >> "$list"
    done
  elif [ "$into" = 1 ] || [ -d "$dest" ]; then
    [ -e "$dest" ] || {{ mkdir -p "$dest"; echo "$dest" >> "$list"; }}
    cp -a "$p" "$dest/"; echo "$dest/$(basename "$p")" >> "$list"
  else
    mkdir -p "$(dirname "$dest")"; cp -a "$p" "$dest"; echo "$dest" >> "$list"
  fi
done
owner={shlex.quote(owner)}; mode={shlex.quote(mode)}
case "$owner" in *:*) ;; *) owner="$owner:$(id -gn "$owner")" ;; esac
while IFS= read -r t; do
  chown -hR "$owner" "$t"
  if [ -n "$mode" ]; then find "$t" ! -type l -exec chmod "$mode" {{}} +; fi
done < "$list"
rm -rf "$d" "$list" "$a"
"""


class TemplateBuilds:
    """Builds of one server, one at a time (the machine is the limit); their logs in memory. Its owner awaits
    `recover` once, before serving."""

    def __init__(self, manager: SandboxManager, db: Database, home: Path) -> None:
        self.m = manager
        self.db = db
        self.templates = Templates(db)
        self.uploads = Uploads(home)
        self.logs: dict[str, BuildLog] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._starting: set[str] = set()  # builds a `start` is writing as `building`, not yet in _tasks
        self._one = asyncio.Lock()
        self.ready_timeout = DEFAULT_READY_TIMEOUT  # seconds a ready command may keep failing
        self._misses: dict[str, float] = {}
        manager.template_resolver = self.resolve

    async def recover(self) -> None:
        """A build this server did not finish will never finish: it is `error` from now on."""
        for b in await self.templates.builds():
            if b.status in ("waiting", "building"):
                await self.templates.put_build(replace(
                    b, status="error", finished_at=time.time(),
                    reason={"message": "the build was interrupted by a server restart", "step": "base"}))

    # -- resolution -------------------------------------------------------------------------------------------
    async def resolve(self, ref: str) -> Snapshot | None:
        """A create's templateID → the Snapshot the manager restores from, or None."""
        if ref.startswith(LAYER_PREFIX):
            layer = await self.templates.get_layer(ref[len(LAYER_PREFIX):])
            if layer is None:
                return None
            return Snapshot(snapshot_id=ref, checkpoint_id=layer.checkpoint_id, sandbox_id="template-build",
                            template_id=ref, names=(ref,))
        build = await self.ready_build(ref)
        if build is None or build.checkpoint_id is None:
            return None
        name, tag = split_ref(ref)
        t = await self.templates.get_template(name)
        label = t.name if t is not None else name
        # "pool": a built template gets a warm pool of restored sandboxes (sandbox/creates.py), one per tag.
        return Snapshot(snapshot_id=build.template_id, checkpoint_id=build.checkpoint_id,
                        sandbox_id=build.sandbox_id or "template-build", template_id=build.template_id,
                        names=(ref,), pool=label if tag == DEFAULT_TAG else f"{label}:{tag}")

    async def ready_build(self, ref: str) -> BuildRecord | None:
        name, tag = split_ref(ref)
        t = await self.templates.get_template(name) or await self._from_store(name, tag)
        if t is None:
            return None
        b = await self.templates.tagged_build(t.template_id, tag)
        return b if b is not None and b.status == "ready" else None

    async def _from_store(self, name: str, tag: str) -> TemplateRecord | None:
        """A template another server sharing the store built: its newest snapshot labelled with this name and tag,
        recorded in this database from now on. A miss is remembered for MISS_TTL seconds (the search reads every
        manifest); this server's own TOML templates are never searched for."""
        if not NAME_RE.match(name) or name in self.m.templates.names() \
                or self._misses.get(f"{name}:{tag}", 0.0) > time.monotonic():
            return None
        found: tuple[dict[str, Any], str] | None = None
        for m in self.m.durable.repo.list_checkpoints():
            try:
                doc = json.loads(m.meta.labels.get("sandbox", "{}")).get("doc", {})
                label = json.loads((doc.get("metadata") or {}).get(STORE_LABEL, "null"))
            except (ValueError, AttributeError):
                continue
            if isinstance(label, dict) and label.get("name") == name and tag in (label.get("tags") or []):
                found = (label, m.checkpoint_id)  # oldest first: the last one wins
        if found is None:
            self._misses[f"{name}:{tag}"] = time.monotonic() + MISS_TTL
            return None
        label, checkpoint_id = found
        now = time.time()
        record = TemplateRecord(template_id=str(label["template_id"]), name=name, cpu=int(label.get("cpu") or 0),
                                memory_mb=int(label.get("memory_mb") or 0), created_at=now, updated_at=now)
        with contextlib.suppress(Conflict):
            await self.templates.put_template(record)
        b = BuildRecord(build_id=str(label["build_id"]), template_id=record.template_id, status="ready",
                        created_at=now, checkpoint_id=checkpoint_id, finished_at=now)
        await self.templates.put_build(b)
        await self.templates.publish_build(b, [str(t) for t in label.get("tags") or []], LayerRecord(
            cache_key=f"build:{b.build_id}", checkpoint_id=checkpoint_id, state=dict(label.get("state") or {})))
        log.info("template %s:%s (%s) found in the shared store: checkpoint %s", name, tag, record.template_id,
                 checkpoint_id)
        return await self.templates.get_template(name)

    async def template(self, ref: str) -> TemplateRecord:
        t = await self.templates.get_template(split_ref(ref)[0])
        if t is None:
            raise NotFound(f"template '{ref}' not found")
        return t

    # -- requests ---------------------------------------------------------------------------------------------
    async def request(self, name: str, tags: list[str], cpu: int,
                      memory_mb: int) -> tuple[TemplateRecord, BuildRecord, list[str]]:
        """`POST /v3/templates`: the template (new, or the one of that name) and a new build in `waiting`."""
        base, tag = split_ref(name)
        if not NAME_RE.match(base):
            raise BadRequest(f"template name {base!r}: lowercase letters, digits and . _ / -, at most 128")
        all_tags = list(dict.fromkeys(([tag] if ":" in name else [DEFAULT_TAG]) + tags))
        for t in all_tags:
            if not TAG_RE.match(t):
                raise BadRequest(f"tag {t!r}: letters, digits and . _ -, at most 128")
        if base in self.m.templates.names():
            raise Conflict(f"'{base}' is a template of this server's own (docs/design/templates.md): pick another "
                           "name")
        now = time.time()
        record = await self.templates.get_template(base)
        if record is None:
            record = TemplateRecord(template_id=new_template_id(), name=base, cpu=cpu, memory_mb=memory_mb,
                                    created_at=now, updated_at=now)
            await self.templates.put_template(record)
        else:
            await self.templates.update_template(record.template_id, cpu, memory_mb)
            record = replace(record, cpu=cpu, memory_mb=memory_mb)
        build = BuildRecord(build_id=str(uuid.uuid4()), template_id=record.template_id, status="waiting",
                            created_at=now, reason={"tags": all_tags})
        await self.templates.put_build(build)
        return record, build, all_tags

    async def build_of(self, template_id: str, build_id: str) -> BuildRecord:
        b = await self.templates.get_build(build_id)
        t = await self.templates.get_template(template_id)
        if b is None or t is None or b.template_id != t.template_id:
            raise NotFound(f"build '{build_id}' of template '{template_id}' not found")
        return b

    async def start(self, template_id: str, build_id: str, spec: BuildSpec, api_key_id: str | None) -> None:
        """Checked here, run in the background; the build is `building` when this returns."""
        b = await self.build_of(template_id, build_id)
        if b.status != "waiting" or build_id in self._tasks or build_id in self._starting:
            raise Conflict(f"build '{build_id}' was started already (it is {b.status})")
        if spec.from_image not in (None, BASE_IMAGE):
            self._oci()  # 501 now, before anything starts, when this server cannot pull images
        for i, s in enumerate(spec.steps, 1):
            if s.type == "COPY" and s.files_hash is not None and not self.uploads.present(s.files_hash):
                raise BadRequest(f"step {i}: the files of {s.describe()} were never uploaded (filesHash "
                                 f"{s.files_hash}): PUT them to the URL of GET /templates/{{id}}/files/{{hash}}")
        tags = list((b.reason or {}).get("tags") or [DEFAULT_TAG])
        self._starting.add(build_id)  # no await between the check above and here: a second start is refused
        try:
            b = replace(b, status="building", reason={"tags": tags})
            await self.templates.put_build(b)
            self.logs[build_id] = BuildLog()
            self._tasks[build_id] = asyncio.get_running_loop().create_task(
                self._run(b, spec, tags, api_key_id), name=f"template-build-{build_id}")
        finally:
            self._starting.discard(build_id)

    async def status(self, template_id: str, build_id: str, offset: int, limit: int) -> dict[str, Any]:
        b = await self.build_of(template_id, build_id)
        entries = self.logs.get(build_id, BuildLog()).entries
        page = entries[offset:offset + limit]
        out: dict[str, Any] = {"templateID": b.template_id, "buildID": b.build_id,
                               "status": "building" if b.status == "waiting" and build_id in self._tasks
                               else b.status, "logs": [e["message"] for e in page], "logEntries": page}
        if b.status == "error" and b.reason:
            out["reason"] = {"message": b.reason.get("message", "build failed"), "step": b.reason.get("step", "base"),
                             "logEntries": entries[-20:]}
        return out

    async def wait(self, build_id: str) -> None:
        task = self._tasks.get(build_id)
        if task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.shield(task)

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(BaseException):
                await task

    async def delete(self, ref: str) -> None:
        """Forget the template, its builds and tags, and delete its snapshots from the store (sandboxes made from
        them need them no more; `store gc` then reclaims what no other checkpoint shares). Step-cache layers stay:
        other templates may start from them."""
        t = await self.template(ref)
        held = await self.templates.delete_template(t.template_id)
        for cp in held:
            self.m.creates.drop_pool(cp)  # its warm sandboxes go too
            await self._forget_checkpoint(cp)
        log.info("template %s (%s) deleted with %d snapshots", t.name, t.template_id, len(held))

    # -- the build --------------------------------------------------------------------------------------------
    @staticmethod
    def _oci() -> Any:
        try:
            from keepstate.template import oci
        except ImportError:
            raise Unsupported("building from an OCI image other than e2bdev/base needs keepstate.template.oci, "
                              "which this server does not have; use fromTemplate or from_base_image()") from None
        return oci

    async def _parent(self, spec: BuildSpec, logs: BuildLog) -> tuple[str, str, State]:
        """(templateID to create the build sandbox from, its cache identity, the state it starts with)."""
        if spec.from_image not in (None, BASE_IMAGE):
            oci = self._oci()
            from keepstate.template.oci.credentials import from_wire

            ref = spec.from_image
            logs.add(f"pulling image {ref}", step="base")
            built = await asyncio.to_thread(oci.pull_template, oci.image_template_name(ref), ref,
                                            from_wire(spec.registry), lambda m: logs.add(m, step="base"))
            d = built.defaults
            state = State(env=dict(d.env), user=d.user or "root", workdir=d.workdir or "/")
            return built.name, f"image:{built.definition_digest}", state
        parent = spec.parent
        if parent in self.m.templates.names():
            from keepstate.sandbox.templates import latest_digest

            digest = await asyncio.to_thread(latest_digest, self.m.templates, parent)
            return parent, f"toml:{parent}:{digest}", State()
        build = await self.ready_build(parent)
        if build is None:
            raise StepFailed("base", f"template '{parent}' not found (no ready build)")
        layer = await self.templates.get_layer(f"build:{build.build_id}")
        return parent, f"build:{build.build_id}", State.from_json(layer.state) if layer else State()

    async def _run(self, b: BuildRecord, spec: BuildSpec, tags: list[str], api_key_id: str | None) -> None:
        logs = self.logs[b.build_id]
        taken: list[str] = []
        try:
            if self._one.locked():
                logs.add("waiting for the build before this one to finish", step="base")
            async with self._one:
                started = time.monotonic()
                await self._build(b, spec, tags, api_key_id, logs, taken)
                logs.add(f"build finished in {time.monotonic() - started:.1f} s")
        except Exception as exc:
            step, message = (exc.step, exc.message) if isinstance(exc, StepFailed) else \
                ("base", f"{type(exc).__name__}: {exc}") if not isinstance(exc, KeepStateError) else \
                ("base", exc.message)
            log.warning("template build %s failed at step %s: %s", b.build_id, step, message)
            logs.add(message, level="error", step=step)
            await self.templates.put_build(replace(b, status="error", finished_at=time.time(),
                                                   reason={"message": message, "step": step}))
            for cp in taken:  # nothing of a failed build survives: `store gc` reclaims the data
                await self._forget_checkpoint(cp)
        except asyncio.CancelledError:
            await self.templates.put_build(replace(
                b, status="error", finished_at=time.time(),
                reason={"message": "the build was cancelled (server stopping)", "step": "base"}))
            raise
        finally:
            self._tasks.pop(b.build_id, None)

    async def _forget_checkpoint(self, checkpoint_id: str) -> None:
        await self.templates.delete_layers_of(checkpoint_id)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.m.durable.repo.delete_checkpoint, checkpoint_id)  # files: off the loop
        with contextlib.suppress(Exception):
            await self.m.recorder.lineage.forget_checkpoint(checkpoint_id)

    async def _build(self, b: BuildRecord, spec: BuildSpec, tags: list[str], api_key_id: str | None,
                     logs: BuildLog, taken: list[str]) -> str:
        from keepstate.sandbox.manager import CreateRequest

        parent, identity, state = await self._parent(spec, logs)
        keys = chain(parent_key(identity), spec.steps)
        n = len(spec.steps)
        hit = 0  # steps[:hit] come from a layer
        layer_state: dict[str, Any] | None = None
        if not spec.force:
            first_forced = next((i for i, s in enumerate(spec.steps) if s.force), n)
            for i in range(min(first_forced, n), 0, -1):
                layer = await self.templates.get_layer(keys[i - 1])
                if layer is not None:
                    hit, layer_state = i, layer.state
                    break
        source = f"{LAYER_PREFIX}{keys[hit - 1]}" if hit else parent
        if layer_state is not None:
            state = State.from_json(layer_state)
        t = await self.templates.get_template(b.template_id)
        assert t is not None
        logs.add(f"[base] build sandbox from {'a cached layer of ' + parent if hit else parent!r}", step="base")
        try:
            row = await self.m.create(CreateRequest(template_id=source, timeout=BUILD_TIMEOUT, cpu=t.cpu or None,
                                                    memory_mb=t.memory_mb or None, gateway=False), api_key_id)
        except KeepStateError as exc:
            raise StepFailed("base", f"the build sandbox could not start from '{parent}': {exc.message}") from None
        sandbox_id = row.sandbox_id
        try:
            with self.m.agents.in_use(sandbox_id):
                return await self._steps_and_finish(b, spec, tags, row, state, keys, hit, logs, taken)
        finally:
            with contextlib.suppress(KeepStateError):
                await self.m.kill(sandbox_id, "template build finished")

    async def _steps_and_finish(self, b: BuildRecord, spec: BuildSpec, tags: list[str], row: SandboxRow,
                                state: State, keys: list[str], hit: int, logs: BuildLog, taken: list[str]) -> str:
        sandbox_id, n = row.sandbox_id, len(spec.steps)
        t = await self.templates.get_template(b.template_id)
        assert t is not None
        for i, s in enumerate(spec.steps, 1):
            if i <= hit:
                logs.add(f"CACHED [{i}/{n}] {s.describe()}", step=str(i))
                continue
            logs.add(f"[{i}/{n}] {s.describe()}", step=str(i))
            await self._step(i, s, row.address, row.access_token, state, logs, sandbox_id)
        if hit < n:
            await self.m.set_defaults(sandbox_id, state.user, state.workdir, state.env)
            cp = await self.m.checkpoint(sandbox_id)
            taken.append(cp)
            await self.templates.put_layer(keys[n - 1], cp, state.to_json())
            logs.add(f"layer cached ({cp})")
        await self._finalize(spec, row.address, row.access_token, state, logs, sandbox_id)
        label = {"name": t.name, "template_id": t.template_id, "build_id": b.build_id, "tags": tags,
                 "cpu": t.cpu, "memory_mb": t.memory_mb, "state": state.to_json()}
        await self.m.set_defaults(sandbox_id, state.user, state.workdir, state.env,
                                  {STORE_LABEL: json.dumps(label, sort_keys=True)})
        try:
            cp = await self.m.checkpoint(sandbox_id)
        except KeepStateError as exc:
            raise StepFailed("finalize", f"the template snapshot failed: {exc.message}") from None
        taken.append(cp)
        ready = replace(b, status="ready", checkpoint_id=cp, sandbox_id=sandbox_id, finished_at=time.time())
        layer = LayerRecord(cache_key=f"build:{b.build_id}", checkpoint_id=cp, state=state.to_json())
        await self.templates.publish_build(ready, tags, layer)  # with its layer: one transaction
        taken.clear()  # published: they are the template's now
        logs.add(f"template {t.name} ({t.template_id}) ready: tags {', '.join(tags)}", step="finalize")
        return sandbox_id

    async def _exec(self, sandbox_id: str, address: str, token: str, cmd: str, user: str, env: dict[str, str],
                    cwd: str | None, logs: BuildLog, step: str) -> CommandResult:
        loop = asyncio.get_running_loop()

        def on_line(line: str) -> None:
            loop.call_soon_threadsafe(logs.add, line, "info", step)
        return await self.m.agents.run_command(sandbox_id, address, token, cmd, user, env, cwd, on_line)

    async def _step(self, i: int, s: Step, address: str, token: str, state: State, logs: BuildLog,
                    sandbox_id: str) -> None:
        where = str(i)
        if s.type in ("ENV", "WORKDIR", "USER"):
            state.apply(s)
            if s.type == "WORKDIR":  # Docker makes it; so does E2B: owned by the current user when it is new
                w, u = shlex.quote(state.workdir), shlex.quote(state.user)
                await self._run_cmd(sandbox_id, address, token,
                                    f'[ -d {w} ] || {{ mkdir -p {w} && chown {u}:"$(id -gn {u})" {w}; }}',
                                    "root", {}, None, logs, where)
            return
        if s.type == "RUN":
            user = s.args[1] if len(s.args) > 1 and s.args[1] else state.user
            await self._run_cmd(sandbox_id, address, token, s.args[0], user, state.env, state.workdir, logs, where)
            return
        src, dest, owner, mode = s.args
        assert s.files_hash is not None
        upload = self.uploads.path(s.files_hash)
        if not upload.is_file():
            raise StepFailed(where, f"the files of step {i} were never uploaded (filesHash {s.files_hash})")

        def verify() -> tuple[str, bool]:
            with open(upload, "rb") as f:
                got = archive_hash(src, dest, f)
            if got == s.files_hash:
                return got, False
            with open(upload, "rb") as f:
                return got, has_directories(f)
        try:
            got, unverifiable = await asyncio.to_thread(verify)
        except Exception as exc:
            raise StepFailed(where, f"the upload of step {i} is not a readable tar archive: {exc}") from None
        if got != s.files_hash and not unverifiable:
            upload.unlink(missing_ok=True)  # not what that hash names: no later files check may call it present
            raise StepFailed(where, f"the upload of step {i} does not match its filesHash: expected "
                                    f"{s.files_hash}, the archive hashes to {got}")
        if unverifiable:
            logs.add(f"step {i}: the upload's filesHash cannot be checked (this SDK release hashes directories' "
                     "on-disk sizes, which a tar does not keep); using it as sent", level="warn", step=where)
        archive = f"/tmp/.keepstate-copy-{s.files_hash}"
        await self.m.agents.write_file(sandbox_id, address, token, archive, upload)
        script = copy_script(archive, src, dest, owner or state.user, mode, state.workdir)
        await self._run_cmd(sandbox_id, address, token, script, "root", {}, None, logs, where,
                            shown=f"COPY {src} {dest}")

    async def _run_cmd(self, sandbox_id: str, address: str, token: str, cmd: str, user: str, env: dict[str, str],
                       cwd: str | None, logs: BuildLog, where: str, shown: str | None = None) -> None:
        r = await self._exec(sandbox_id, address, token, cmd, user, env, cwd, logs, where)
        shown = shown or cmd
        if r.error is not None:
            raise StepFailed(where, f"failed to run command '{shown}': command failed: {r.error}")
        if r.exit_code != 0:
            tail = "\n".join(r.tail[-TAIL_LINES:])
            raise StepFailed(where, f"failed to run command '{shown}': exit status {r.exit_code}"
                                    + (f"; last output:\n{tail}" if tail else ""))

    async def _finalize(self, spec: BuildSpec, address: str, token: str, state: State, logs: BuildLog,
                        sandbox_id: str) -> None:
        if spec.start_cmd:
            logs.add(f"start command: {spec.start_cmd}", step="finalize")
            detached = (f"setsid nohup bash -l -c {shlex.quote(spec.start_cmd)} >/tmp/keepstate-start.log 2>&1 "
                        "</dev/null &")
            r = await self._exec(sandbox_id, address, token, detached, state.user, state.env, state.workdir, logs,
                                 "finalize")
            if r.error is not None or r.exit_code != 0:
                raise StepFailed("finalize", f"failed to run start command '{spec.start_cmd}': "
                                             f"{r.error or 'exit status ' + str(r.exit_code)}")
        if spec.ready_cmd:
            logs.add(f"waiting for the ready command: {spec.ready_cmd}", step="finalize")
            deadline = time.monotonic() + self.ready_timeout
            while True:
                r = await self._exec(sandbox_id, address, token, spec.ready_cmd, state.user, state.env,
                                     state.workdir, logs, "finalize")
                if r.error is not None:
                    raise StepFailed("finalize", f"failed to run ready command '{spec.ready_cmd}': {r.error}")
                if r.exit_code == 0:
                    break
                if time.monotonic() > deadline:
                    raise StepFailed("finalize", f"ready command '{spec.ready_cmd}' did not succeed within "
                                                 f"{self.ready_timeout:.0f} s (the ready timeout); last exit "
                                                 f"status {r.exit_code}")
                await asyncio.sleep(1.0)  # the poll interval of E2B's builder
            logs.add("ready", step="finalize")
