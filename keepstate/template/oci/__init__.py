"""Pull any OCI image into a root directory and register it as a root template build.

`pull(ref, credentials, dest)` resolves the reference (index → this platform's manifest), fetches the config and
the layers into a blob cache under the template cache (verified, so a second pull downloads nothing), and unpacks
the layers in order into `dest`. `pull_template(name, ref)` does that into the builder's layout
(`<cache>/<name>/<id>/rootfs`, `build.json`, `current`) and adds the files every sandbox needs from us.
Format and rules: docs/design/oci-images.md.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform as _platform
import re
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from keepstate.errors import BadRequest
from keepstate.mountpoints import TEMPLATE_VIEW, VOLUME_SLOTS, VOLUMES_DIR

from .. import builder
from ..builder import Built, Progress, stderr_progress, templates_dir
from ..definition import Defaults
from .errors import DigestMismatch, ImageNotFound, UnsupportedImage
from .ref import Reference, parse
from .registry import CONFIG_TYPES, INDEX_TYPES, LAYER_TYPES, Credentials, Manifest, Registry, sha256_digest
from .unpack import apply_layer, remove, secure_join

FORMAT = "oci-v1"  # enters a build's ID: bump when what `register` adds to an image changes
AGENT_RUNTIME = "/opt/keepstate"  # the agent's own runtime is mounted here read-only (another module's seam)


@dataclass(frozen=True)
class ImageConfig:
    """What the image says a container of it runs with."""

    env: dict[str, str] = field(default_factory=dict)
    user: str = ""
    workdir: str = ""
    cmd: list[str] = field(default_factory=list)
    entrypoint: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, doc: dict[str, object]) -> ImageConfig:
        c = doc.get("config") or {}
        if not isinstance(c, dict):
            c = {}
        env: dict[str, str] = {}
        for item in c.get("Env") or []:
            k, _, v = str(item).partition("=")
            env[k] = v
        return cls(env=env, user=str(c.get("User") or ""), workdir=str(c.get("WorkingDir") or ""),
                   cmd=[str(x) for x in c.get("Cmd") or []], entrypoint=[str(x) for x in c.get("Entrypoint") or []])

    def as_json(self) -> dict[str, object]:
        return {"env": self.env, "user": self.user, "workdir": self.workdir, "cmd": self.cmd,
                "entrypoint": self.entrypoint}


@dataclass(frozen=True)
class ImageRoot:
    rootfs: Path
    config: ImageConfig
    reference: str
    manifest_digest: str
    config_digest: str
    platform: str
    downloaded: list[str]  # digests of the blobs this pull fetched (none on a cache hit)


@dataclass(frozen=True)
class Resolved:
    """An image reference resolved to one platform's manifest, before any layer is fetched."""

    ref: Reference
    manifest: Manifest
    platform: str

    @property
    def build_id(self) -> str:
        """The definition digest of an image build: the manifest says everything its root will hold."""
        return hashlib.sha256(f"{FORMAT}\0{self.manifest.digest}\0{self.platform}".encode()).hexdigest()


def this_platform() -> tuple[str, str]:
    m = _platform.machine()
    return "linux", {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(m, m)


def blobs_dir() -> Path:
    d = templates_dir() / ".oci" / "blobs" / "sha256"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _blob_path(digest: str) -> Path:
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise UnsupportedImage(f"unsupported digest `{digest}` (only sha256)")
    return blobs_dir() / digest.split(":", 1)[1]


class _Puller:
    def __init__(self, ref: Reference, credentials: Credentials | None) -> None:
        self.ref = ref
        self.registry = Registry(ref, credentials)
        self.authed = False
        self.downloaded: list[str] = []

    def _reg(self) -> Registry:
        if not self.authed:
            self.registry.authenticate()
            self.authed = True
        return self.registry

    def manifest(self, ref: str) -> Manifest:
        """A manifest by tag (always asked: tags move) or by digest (from the cache when there)."""
        if ref.startswith("sha256:"):
            cached = _blob_path(ref)
            if cached.exists():
                body = cached.read_bytes()
                if sha256_digest(body) == ref:
                    doc = json.loads(body)
                    media = doc.get("mediaType") or (INDEX_TYPES[0] if "manifests" in doc else "")
                    return Manifest(media_type=media or "application/vnd.oci.image.manifest.v1+json",
                                    body=body, digest=ref)
        m = self._reg().manifest(ref)
        path = _blob_path(m.digest)
        if not path.exists():
            tmp = path.with_name(f".tmp-{path.name}-{secrets.token_hex(6)}")
            tmp.write_bytes(m.body)
            os.replace(tmp, path)
        return m

    def resolve(self) -> Resolved:
        os_, arch = this_platform()
        m = self.manifest(self.ref.ref)
        if m.media_type in INDEX_TYPES:
            entries = m.json().get("manifests") or []
            found = []
            pick = None
            for e in entries if isinstance(entries, list) else []:
                p = e.get("platform") or {}
                found.append(f"{p.get('os')}/{p.get('architecture')}")
                if p.get("os") == os_ and p.get("architecture") == arch and pick is None:
                    pick = e
            if pick is None:
                raise UnsupportedImage(f"image {self.ref} has no {os_}/{arch} manifest (it has: "
                                       f"{', '.join(found) or 'none'})")
            m = self.manifest(str(pick["digest"]))
            if m.media_type in INDEX_TYPES:
                raise UnsupportedImage(f"image {self.ref}: an index inside an index is not supported")
        return Resolved(ref=self.ref, manifest=m, platform=f"{os_}/{arch}")

    def blob(self, desc: dict[str, object]) -> Path:
        digest = str(desc.get("digest", ""))
        size = desc.get("size")
        path = _blob_path(digest)
        if path.exists() and (not isinstance(size, int) or path.stat().st_size == size):
            return path
        self._reg().blob_to(digest, size if isinstance(size, int) else None, path)
        self.downloaded.append(digest)
        return path


def _descriptors(r: Resolved) -> tuple[dict[str, object], list[dict[str, object]]]:
    doc = r.manifest.json()
    config = doc.get("config")
    layers = doc.get("layers")
    if not isinstance(config, dict) or not isinstance(layers, list):
        raise UnsupportedImage(f"manifest {r.manifest.digest} of image {r.ref} has no config or layers")
    if config.get("mediaType") not in CONFIG_TYPES:
        raise UnsupportedImage(f"unsupported media type {config.get('mediaType')} for the config of image {r.ref}")
    for layer in layers:
        if not isinstance(layer, dict) or layer.get("mediaType") not in LAYER_TYPES:
            mt = layer.get("mediaType") if isinstance(layer, dict) else layer
            raise UnsupportedImage(f"unsupported media type {mt} for a layer of image {r.ref}")
    return config, layers


def _quiet(msg: str) -> None:
    pass


def _pull_resolved(p: _Puller, r: Resolved, dest: Path, progress: Progress = _quiet) -> ImageRoot:
    config_desc, layers = _descriptors(r)
    config_path = p.blob(config_desc)
    try:
        config_doc = json.loads(config_path.read_bytes())
    except ValueError as e:
        raise UnsupportedImage(f"the config of image {r.ref} is not JSON: {e}") from e
    diff_ids = (config_doc.get("rootfs") or {}).get("diff_ids") or []
    if diff_ids and len(diff_ids) != len(layers):
        raise DigestMismatch(f"image {r.ref}: {len(layers)} layers but the config lists {len(diff_ids)} diff IDs")
    total = sum(int(str(d.get("size", 0))) for d in layers)
    progress(f"{r.ref}: {len(layers)} layers, {total / (1 << 20):.1f} MiB")
    blobs = []
    for i, desc in enumerate(layers):  # all fetched and verified before the root is touched
        before = len(p.downloaded)
        blobs.append(p.blob(desc))
        how = "downloaded" if len(p.downloaded) > before else "cached"
        progress(f"{r.ref}: layer {i + 1}/{len(layers)} {str(desc['digest'])[:19]} {how}")
    dest.mkdir(parents=True, exist_ok=True)
    os.chmod(dest, 0o755)
    for i, (desc, blob) in enumerate(zip(layers, blobs, strict=True)):
        progress(f"{r.ref}: unpack layer {i + 1}/{len(layers)}")
        apply_layer(dest, blob, f"{i + 1}/{len(layers)} {desc['digest']}", diff_ids[i] if diff_ids else None)
    return ImageRoot(rootfs=dest, config=ImageConfig.from_json(config_doc), reference=str(r.ref),
                     manifest_digest=r.manifest.digest, config_digest=str(config_desc["digest"]),
                     platform=r.platform, downloaded=list(p.downloaded))


def pull(ref: str | Reference, credentials: Credentials | None = None, *, dest: Path,
         progress: Progress = _quiet) -> ImageRoot:
    """Pull an image into `dest` (made if missing; meant to be empty): layers applied in order, every digest
    verified. Nothing is written to `dest` before every blob is in the cache and verified."""
    reference = parse(ref) if isinstance(ref, str) else ref
    p = _Puller(reference, credentials)
    return _pull_resolved(p, p.resolve(), dest, progress)


# -- the image as a template build -------------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _write(rootfs: Path, rel: str, text: str) -> None:
    """Write one of our files into the image root: parents resolved inside it, a symlink at the spot replaced."""
    dname, base = os.path.split(rel)
    parent = secure_join(rootfs, dname)
    parent.mkdir(parents=True, exist_ok=True)
    remove(parent / base)
    (parent / base).write_text(text)


def finish_image_root(rootfs: Path, name: str, config: ImageConfig) -> Defaults:
    """The files every sandbox needs from us (as builder._finish_root), for a root that came from an image."""
    defaults = Defaults(user=config.user or "root", workdir=config.workdir or "/", env=dict(config.env))
    _write(rootfs, "etc/keepstate/template.json", json.dumps({
        "name": name, "user": defaults.user, "workdir": defaults.workdir, "env": defaults.env, "services": [],
        "image": config.as_json(),
    }, indent=1))
    _write(rootfs, "etc/hosts", "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost\n")
    # No resolver is reachable from a sandbox: fail lookups at once instead of timing out.
    _write(rootfs, "etc/resolv.conf", "options timeout:1 attempts:1\n")
    # Every mount point a sandbox's spec names; the agent's runtime goes on AGENT_RUNTIME, left empty here.
    for point in (AGENT_RUNTIME, f"{AGENT_RUNTIME}/lib/keepstate", TEMPLATE_VIEW,
                  *(f"{VOLUMES_DIR}/{i}" for i in range(VOLUME_SLOTS))):
        d = secure_join(rootfs, point.lstrip("/"))
        if d.is_symlink() or (d.exists() and not d.is_dir()):
            remove(d)
        d.mkdir(parents=True, exist_ok=True)
    for point in ("tmp", "proc", "dev", "sys"):
        d = secure_join(rootfs, point)
        if not d.is_dir():
            remove(d)
            d.mkdir(mode=0o1777 if point == "tmp" else 0o755)
    return defaults


def _read(name: str, build_id: str) -> Built | None:
    final = templates_dir() / name / build_id
    try:
        info = json.loads((final / "build.json").read_text())
    except (OSError, ValueError):
        return None
    t = info.get("template", {})
    return Built(name=name, definition_digest=build_id, digest=info["digest"], rootfs=final / "rootfs",
                 defaults=Defaults(user=t.get("user", "root"), workdir=t.get("workdir", "/"),
                                   env=t.get("env", {})), built_at=info["built_at"])


IMAGE_PREFIX = "image-"


def image_template_name(ref: str) -> str:
    """The template name an image reference is published under for builds (`fromImage`): one per reference, so
    pulling it again reuses (or, when the tag moved, replaces) the same template's build."""
    import hashlib

    return IMAGE_PREFIX + hashlib.sha256(ref.strip().encode()).hexdigest()[:20]


def is_image_template(name: str) -> bool:
    return name.startswith(IMAGE_PREFIX)


def latest(name: str) -> Built | None:
    """The current build of an image template, or None (never pulled here)."""
    link = templates_dir() / name / "current"
    if not link.is_symlink():
        return None
    return _read(name, os.readlink(link))


def find_by_digest(name: str, digest: str) -> Built | None:
    """A build of image template `name` whose root filesystem has this digest (a checkpoint's), if any."""
    tdir = templates_dir() / name
    if not tdir.is_dir():
        return None
    for d in sorted(tdir.iterdir()):
        if d.name.startswith(".") or d.name == "current":
            continue
        b = _read(name, d.name)
        if b is not None and b.digest == digest:
            return b
    return None


def pull_template(name: str, ref: str | Reference, credentials: Credentials | None = None,
                  progress: Progress = stderr_progress, force: bool = False) -> Built:
    """Pull `ref` and publish it as a build of template `name`; the same image again reuses the build."""
    if not _NAME.fullmatch(name):
        raise BadRequest(f"template name `{name}` must match {_NAME.pattern}")
    reference = parse(ref) if isinstance(ref, str) else ref
    p = _Puller(reference, credentials)
    r = p.resolve()
    tdir = templates_dir() / name
    tdir.mkdir(parents=True, exist_ok=True)
    with open(tdir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and (b := _read(name, r.build_id)) is not None:
            _point_current(tdir, r.build_id)
            return b
        return _build(p, r, name, tdir, progress)


def _build(p: _Puller, r: Resolved, name: str, tdir: Path, progress: Progress) -> Built:
    started = time.monotonic()
    work = tdir / f".build-{r.build_id[:12]}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        progress(f"template {name}: pull {r.ref} ({r.manifest.digest[:19]})")
        image = _pull_resolved(p, r, work / "rootfs", lambda m: progress(f"template {name}: {m}"))
        defaults = finish_image_root(image.rootfs, name, image.config)
        progress(f"template {name}: digest of the root filesystem")
        digest = builder.rootfs_digest(image.rootfs)
        built_at = time.time()
        (work / "build.json").write_text(json.dumps({
            "name": name, "definition_digest": r.build_id, "digest": digest, "built_at": built_at,
            "parent": None, "packages": [], "seconds": round(time.monotonic() - started, 1),
            "source": {"image": str(r.ref), "manifest": r.manifest.digest, "config": image.config_digest,
                       "platform": r.platform},
            "image_config": image.config.as_json(),
            "template": {"user": defaults.user, "workdir": defaults.workdir, "env": defaults.env},
        }, indent=1))
        final = tdir / r.build_id
        if final.exists():
            os.rename(final, tdir / f".retired-{r.build_id[:12]}-{int(time.time())}")
        os.rename(work, final)
        _point_current(tdir, r.build_id)
        progress(f"template {name} from {r.ref} in {time.monotonic() - started:.0f}s, "
                 f"{len(image.downloaded)} blobs downloaded, digest {digest[:16]}")
        return Built(name=name, definition_digest=r.build_id, digest=digest, rootfs=final / "rootfs",
                     defaults=defaults, built_at=built_at)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _point_current(tdir: Path, build_id: str) -> None:
    link = tdir / "current"
    if link.is_symlink() and os.readlink(link) == build_id:
        return
    tmp = tdir / f".current-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(build_id)
    os.replace(tmp, link)


__all__ = ["AGENT_RUNTIME", "IMAGE_PREFIX", "Credentials", "ImageConfig", "ImageNotFound", "ImageRoot",
           "find_by_digest", "finish_image_root", "image_template_name", "is_image_template", "latest", "pull",
           "pull_template"]
