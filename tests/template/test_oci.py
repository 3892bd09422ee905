"""Images pulled from a real registry on loopback (Debian's docker-registry, pushed to by skopeo) unpack into the
tree their layers describe, every digest checked, credentials honoured, nothing downloaded twice."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from keepstate.errors import BadRequest
from keepstate.template import builder, oci
from keepstate.template.oci import ref as oci_ref
from keepstate.template.oci.errors import (
    DigestMismatch,
    ImageNotFound,
    RegistryAuthFailed,
    RegistryUnavailable,
    UnsafeLayer,
    UnsupportedImage,
)
from keepstate.template.oci.registry import Credentials
from keepstate.template.oci.unpack import apply_layer
from keepstate.testing import oci_layout
from keepstate.testing.oci_layout import Entry
from keepstate.testing.registry import Registry

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="unpacking images keeps owners: needs root")

ALICE = ("alice", "s3cret-pass")


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, oci_layout.Layout]:
    d = tmp_path_factory.mktemp("layouts")
    return {"two": oci_layout.two_layer_image(d / "two"),
            "two-zstd": oci_layout.two_layer_image(d / "two-zstd", compression="zstd"),
            "two-plain": oci_layout.two_layer_image(d / "two-plain", compression=None),
            "busybox": oci_layout.busybox_image(d / "busybox")}


@pytest.fixture(scope="module")
def registry(layouts: dict[str, oci_layout.Layout]) -> Iterator[Registry]:
    with Registry() as reg:
        reg.push_layout(layouts["two"].dir, "test/two:v1")
        reg.push_layout(layouts["two-zstd"].dir, "test/two-zstd:v1")
        reg.push_layout(layouts["two-plain"].dir, "test/two-plain:v1")
        reg.push_layout(layouts["busybox"].dir, "test/busybox:1", fmt="v2s2")  # Docker's media types
        yield reg


@pytest.fixture(scope="module")
def auth_registry(layouts: dict[str, oci_layout.Layout]) -> Iterator[Registry]:
    with Registry(auth=ALICE) as reg:
        reg.push_layout(layouts["busybox"].dir, "private/busybox:1")
        yield reg


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    c = tmp_path / "templates"
    monkeypatch.setenv("KEEPSTATE_TEMPLATE_CACHE", str(c))
    monkeypatch.delenv(oci_ref.MIRROR_ENV, raising=False)
    return c


def check_two_layer_tree(root: Path) -> None:
    assert (root / "etc/a").read_text() == "a\n"
    assert not (root / "etc/gone").exists(), "whiteout .wh.gone must delete the lower layer's file"
    assert sorted(os.listdir(root / "opt/old")) == ["new"], "opaque dir hides x and sub/ of the lower layer"
    assert stat.S_IMODE(os.stat(root / "opt/old").st_mode) == 0o750
    assert os.readlink(root / "etc/link") == "a" and os.readlink(root / "etc/abs") == "/etc/a"
    a, hard = os.stat(root / "etc/a"), os.stat(root / "etc/hard")
    assert (a.st_ino, a.st_nlink) == (hard.st_ino, 2)
    tool = os.stat(root / "usr/bin/tool")
    assert (stat.S_IMODE(tool.st_mode), tool.st_uid, tool.st_gid) == (0o4755, 1000, 1000)
    assert stat.S_ISFIFO(os.lstat(root / "run/fifo").st_mode)
    assert (root / "was-file").is_dir() and stat.S_IMODE(os.stat(root / "was-file").st_mode) == 0o700
    assert (root / "was-dir").read_text() == "now a file\n"
    assert os.stat(root / "home/user/hello.txt").st_uid == 1000
    leftovers = [os.path.join(d, n) for d, ds, fs in os.walk(root) for n in ds + fs if n.startswith(".wh.")]
    assert leftovers == []


def test_pull_by_tag_multi_layer_whiteouts(registry: Registry, tmp_path: Path) -> None:
    img = oci.pull(f"{registry.host}/test/two:v1", dest=tmp_path / "root")
    check_two_layer_tree(img.rootfs)
    assert img.config == oci.ImageConfig(env={"PATH": "/usr/bin:/bin", "GREETING": "hi there"}, user="1000:1000",
                                         workdir="/home/user", cmd=["/bin/sh"], entrypoint=["/usr/bin/tool"])
    assert img.platform == "linux/amd64" and len(img.downloaded) == 3  # config and two layers


def test_pull_by_digest_same_tree(registry: Registry, layouts: dict[str, oci_layout.Layout], tmp_path: Path) -> None:
    digest = layouts["two"].manifest_digest
    by_tag = oci.pull(f"{registry.host}/test/two:v1", dest=tmp_path / "a")
    by_digest = oci.pull(f"{registry.host}/test/two@{digest}", dest=tmp_path / "b")
    assert by_digest.manifest_digest == by_tag.manifest_digest == digest
    assert builder.rootfs_digest(by_digest.rootfs) == builder.rootfs_digest(by_tag.rootfs)


def test_zstd_plain_and_docker_media_types(registry: Registry, tmp_path: Path) -> None:
    gz = oci.pull(f"{registry.host}/test/two:v1", dest=tmp_path / "gz")
    zst = oci.pull(f"{registry.host}/test/two-zstd:v1", dest=tmp_path / "zst")
    plain = oci.pull(f"{registry.host}/test/two-plain:v1", dest=tmp_path / "plain")
    assert builder.rootfs_digest(zst.rootfs) == builder.rootfs_digest(gz.rootfs) == builder.rootfs_digest(
        plain.rootfs)
    bb = oci.pull(f"{registry.host}/test/busybox:1", dest=tmp_path / "bb")
    manifest = (oci.blobs_dir() / bb.manifest_digest[7:]).read_bytes()
    assert json.loads(manifest)["mediaType"] == "application/vnd.docker.distribution.manifest.v2+json"
    assert os.readlink(bb.rootfs / "bin/sh") == "busybox"
    assert (bb.rootfs / "bin/busybox").read_bytes() == Path("/bin/busybox").read_bytes()
    assert not (bb.rootfs / "usr/bin/python3").exists() and not list(bb.rootfs.glob("lib*/libc.so*"))


def test_corrupt_blob_in_registry_is_refused(layouts: dict[str, oci_layout.Layout], tmp_path: Path) -> None:
    with Registry() as reg:
        reg.push_layout(layouts["two"].dir, "test/two:v1")
        manifest = json.loads(layouts["two"].blobs[layouts["two"].manifest_digest])
        layer = manifest["layers"][1]["digest"]
        data = bytearray(reg.blob_file(layer).read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size, other content
        reg.blob_file(layer).write_bytes(bytes(data))
        with pytest.raises(DigestMismatch) as e:
            oci.pull(f"{reg.host}/test/two:v1", dest=tmp_path / "root")
    assert f"digest mismatch for blob {layer}" in e.value.message and e.value.status == 422
    assert not (oci.blobs_dir() / layer[7:]).exists(), "a blob that failed verification is not cached"
    assert not list(oci.blobs_dir().glob(".tmp-*"))


def test_not_found(registry: Registry, tmp_path: Path) -> None:
    for ref in (f"{registry.host}/test/nope:v1", f"{registry.host}/test/two:v9"):
        with pytest.raises(ImageNotFound) as e:
            oci.pull(ref, dest=tmp_path / "root")
        assert e.value.body() == {"code": 404, "message": f"image {ref} not found"}


def test_auth(auth_registry: Registry, tmp_path: Path) -> None:
    ref = f"{auth_registry.host}/private/busybox:1"
    with pytest.raises(RegistryAuthFailed) as e:
        oci.pull(ref, dest=tmp_path / "anon")
    assert e.value.status == 401 and "needs credentials" in e.value.message
    with pytest.raises(RegistryAuthFailed) as e:
        oci.pull(ref, Credentials("alice", "wrong"), dest=tmp_path / "wrong")
    assert "refused the credentials of user `alice`" in e.value.message
    assert not (tmp_path / "anon").exists() and not (tmp_path / "wrong").exists()
    img = oci.pull(ref, Credentials(*ALICE), dest=tmp_path / "right")
    assert os.readlink(img.rootfs / "bin/sh") == "busybox"


def test_unreachable_registry(tmp_path: Path) -> None:
    import socket
    with socket.socket() as s:  # a port that was free a moment ago and that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RegistryUnavailable) as e:
        oci.pull(f"127.0.0.1:{port}/test/two:v1", dest=tmp_path / "root")
    assert f"registry 127.0.0.1:{port} is unreachable" in e.value.message and e.value.status == 503


def test_cache_hit_downloads_nothing(registry: Registry, layouts: dict[str, oci_layout.Layout], cache: Path) -> None:
    ref = f"{registry.host}/test/two:v1"
    registry.wait_logged("/v2/sentinel-before/tags/list")
    before = len(registry.blob_gets())
    first = oci.pull_template("two", ref, progress=lambda _: None)
    registry.wait_logged("/v2/sentinel-first/tags/list")
    assert len(registry.blob_gets()) == before + 3
    second = oci.pull_template("two", ref, progress=lambda _: None)
    assert second.rootfs == first.rootfs and second.digest == first.digest
    # Into another place, by digest: the cached manifest answers, and no request at all reaches the registry.
    n_logged = len(registry.access_log())
    digest = layouts["two"].manifest_digest
    again = oci.pull(f"{registry.host}/test/two@{digest}", dest=cache.parent / "again")
    assert again.downloaded == []
    registry.wait_logged("/v2/sentinel-second/tags/list")
    assert len(registry.blob_gets()) == before + 3, "no blob is downloaded twice"
    assert len(registry.access_log()) == n_logged + 1  # only the sentinel
    check_two_layer_tree(again.rootfs)


def test_pull_template_layout(registry: Registry, cache: Path) -> None:
    built = oci.pull_template("bb", f"{registry.host}/test/busybox:1", progress=lambda _: None)
    tdir = cache / "bb"
    assert os.readlink(tdir / "current") == built.definition_digest
    assert built.rootfs == tdir / built.definition_digest / "rootfs"
    info = json.loads((tdir / built.definition_digest / "build.json").read_text())
    assert info["digest"] == built.digest == builder.rootfs_digest(built.rootfs)
    assert info["source"]["image"] == f"{registry.host}/test/busybox:1" and info["parent"] is None
    tj = json.loads((built.rootfs / "etc/keepstate/template.json").read_text())
    assert (tj["name"], tj["user"], tj["env"]) == ("bb", "root", {"PATH": "/bin"})
    assert (built.rootfs / "etc/resolv.conf").read_text().startswith("options")
    assert "localhost" in (built.rootfs / "etc/hosts").read_text()
    for point in ("opt/keepstate/lib/keepstate", "opt/keepstate/template", "opt/keepstate/volumes/15", "proc"):
        assert (built.rootfs / point).is_dir(), point
    assert not [p for p in tdir.iterdir() if p.name.startswith(".build-")]


def _blob(tmp: Path, entries: list[Entry]) -> Path:
    p = tmp / f"layer-{len(list(tmp.glob('layer-*')))}.tar"
    p.write_bytes(oci_layout.tar_layer(entries))
    return p


def test_layer_cannot_escape_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(UnsafeLayer, match="escapes the root"):
        apply_layer(root, _blob(tmp_path, [Entry("../escaped", data=b"x")]), "1")
    assert not (tmp_path / "escaped").exists()
    # A symlinked parent pointing at the host's / is followed as if the root were /: it lands inside the root.
    outside = tmp_path / "outside"
    outside.mkdir()
    apply_layer(root, _blob(tmp_path, [Entry("evil", "symlink", target=str(outside)),
                                       Entry("up", "symlink", target="../../../../"),
                                       Entry("etc2", "symlink", target="/")]), "2")
    apply_layer(root, _blob(tmp_path, [Entry("evil/planted", data=b"p"), Entry("up/planted2", data=b"q"),
                                       Entry("etc2/planted3", data=b"r")]), "3")
    assert list(outside.iterdir()) == []
    assert (root / outside.relative_to("/") / "planted").read_bytes() == b"p"
    assert (root / "planted2").read_bytes() == b"q" and (root / "planted3").read_bytes() == b"r"
    # A hardlink to a host file resolves inside the root (where it does not exist) and is refused.
    secret = tmp_path / "secret"
    secret.write_text("host")
    with pytest.raises(UnsafeLayer, match="hardlink"):
        apply_layer(root, _blob(tmp_path, [Entry("h", "hardlink", target=str(secret))]), "4")
    # A file over a symlink replaces the link; it does not write through it.
    apply_layer(root, _blob(tmp_path, [Entry("to-secret", "symlink", target=str(secret))]), "5")
    apply_layer(root, _blob(tmp_path, [Entry("to-secret", data=b"overwritten")]), "6")
    assert secret.read_text() == "host" and (root / "to-secret").read_bytes() == b"overwritten"


def test_diff_id_checked(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    blob = _blob(tmp_path, [Entry("f", data=b"1")])
    good = "sha256:" + hashlib.sha256(blob.read_bytes()).hexdigest()
    assert apply_layer(root, blob, "1", good) == good
    with pytest.raises(DigestMismatch, match="diff ID"):
        apply_layer(root, blob, "1", "sha256:" + "0" * 64)


def test_not_a_tar(tmp_path: Path) -> None:
    blob = tmp_path / "junk"
    blob.write_bytes(b"\x1f\x8b" + b"not gzip at all" * 10)
    with pytest.raises(UnsafeLayer, match="not a valid"):
        apply_layer(tmp_path, blob, "1")


def test_references(monkeypatch: pytest.MonkeyPatch) -> None:
    r = oci_ref.parse("127.0.0.1:5000/team/app:1.2")
    assert (r.host, r.repository, r.tag, r.digest, r.scheme) == ("127.0.0.1:5000", "team/app", "1.2", None, "http")
    d = "sha256:" + "a" * 64
    r = oci_ref.parse(f"registry.example.test/app@{d}")
    assert (r.ref, r.scheme, str(r)) == (d, "https", f"registry.example.test/app@{d}")
    assert oci_ref.parse("localhost/app").tag == "latest"
    with pytest.raises(BadRequest, match="names no registry"):
        oci_ref.parse("alpine:3")
    with pytest.raises(BadRequest, match="names no registry"):
        oci_ref.parse("library/python")
    for bad in ("127.0.0.1:5000/App:1", "127.0.0.1:5000/app:-x", "127.0.0.1:5000/app@sha256:12", "", "h.test/"):
        with pytest.raises(BadRequest):
            oci_ref.parse(bad)
    monkeypatch.setenv(oci_ref.MIRROR_ENV, "127.0.0.1:5001")
    assert str(oci_ref.parse("alpine:3")) == "127.0.0.1:5001/library/alpine:3"
    assert str(oci_ref.parse("docker.io/team/app")) == "127.0.0.1:5001/team/app:latest"
    assert str(oci_ref.parse("quay.example.test/a/b:c")) == "quay.example.test/a/b:c"
    monkeypatch.setenv(oci_ref.INSECURE_ENV, "reg.internal.test:8080")
    assert oci_ref.parse("reg.internal.test:8080/a").scheme == "http"


def test_unsupported_media_type(tmp_path: Path) -> None:
    """A manifest naming a layer type we do not unpack is refused before anything is fetched."""
    with Registry() as reg:
        lay = oci_layout.two_layer_image(tmp_path / "lay")
        manifest = json.loads(lay.blobs[lay.manifest_digest])
        manifest["layers"][0]["mediaType"] = "application/vnd.example.not-a-layer"
        body = json.dumps(manifest).encode()
        mdesc = lay.blob(body)
        index = json.loads((lay.dir / "index.json").read_text())
        index["manifests"][0].update(mdesc)
        (lay.dir / "index.json").write_text(json.dumps(index))
        reg.push_layout(lay.dir, "test/odd:v1")
        with pytest.raises(UnsupportedImage) as e:
            oci.pull(f"{reg.host}/test/odd:v1", dest=tmp_path / "root")
    assert "unsupported media type application/vnd.example.not-a-layer" in e.value.message
    assert e.value.status == 501




def test_bearer_token_auth(layouts: dict[str, oci_layout.Layout], tmp_path: Path) -> None:
    """The registry sends clients to a token service (WWW-Authenticate: Bearer realm=...,service=...)."""
    with Registry(auth=ALICE, token=True) as reg:
        assert reg.tokens is not None
        reg.push_layout(layouts["busybox"].dir, "private/busybox:1")
        ref = f"{reg.host}/private/busybox:1"
        with pytest.raises(RegistryAuthFailed) as e:
            oci.pull(ref, dest=tmp_path / "anon")  # an anonymous token grants nothing
        assert "needs credentials" in e.value.message
        with pytest.raises(RegistryAuthFailed) as e:
            oci.pull(ref, Credentials("alice", "wrong"), dest=tmp_path / "wrong")
        assert "token service refused the credentials of user `alice`" in e.value.message
        img = oci.pull(ref, Credentials(*ALICE), dest=tmp_path / "right")
        assert os.readlink(img.rootfs / "bin/sh") == "busybox"
        assert ("alice", "repository:private/busybox:pull") in reg.tokens.issued


def test_image_index_picks_this_platform(tmp_path: Path) -> None:
    with Registry() as reg:
        multi = oci_layout.as_index(oci_layout.two_layer_image(tmp_path / "multi"), ["linux/arm64", "linux/amd64"])
        other = oci_layout.as_index(oci_layout.two_layer_image(tmp_path / "other"), ["linux/arm64", "linux/s390x"])
        index = reg.push_layout(multi.dir, "test/multi:v1")
        reg.push_layout(other.dir, "test/other:v1")
        img = oci.pull(f"{reg.host}/test/multi:v1", dest=tmp_path / "root")
        with pytest.raises(UnsupportedImage) as e:
            oci.pull(f"{reg.host}/test/other:v1", dest=tmp_path / "none")
    amd64 = json.loads(multi.blobs[index])["manifests"][1]["digest"]
    assert img.manifest_digest == amd64 and img.platform == "linux/amd64"
    check_two_layer_tree(img.rootfs)
    assert "has no linux/amd64 manifest (it has: linux/arm64, linux/s390x)" in e.value.message


def test_rootfs_round_trip(registry: Registry, tmp_path: Path) -> None:
    """A directory tree pushed as an image comes back identical: contents, modes, owners, links, hardlinks."""
    src = tmp_path / "src"
    oci.pull(f"{registry.host}/test/two:v1", dest=src)
    lay = oci_layout.rootfs_image(src, tmp_path / "lay", {"Env": ["A=1"]})
    registry.push_layout(lay.dir, "test/tree:v1")
    img = oci.pull(f"{registry.host}/test/tree:v1", dest=tmp_path / "back")
    assert builder.rootfs_digest(img.rootfs) == builder.rootfs_digest(src)
    assert os.stat(img.rootfs / "etc/hard").st_ino == os.stat(img.rootfs / "etc/a").st_ino
