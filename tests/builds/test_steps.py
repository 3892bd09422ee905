"""The pure half of template builds: steps parsed and checked, cache keys, and the upload hash recomputed from a tar
exactly as the stock SDK computes it from the files (docs/design/template-builds.md)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from e2b.template.utils import calculate_files_hash, tar_file_stream

from keepstate.builds.steps import (
    State,
    Step,
    archive_hash,
    chain,
    is_gzip,
    parent_key,
    parse_spec,
)
from keepstate.builds.uploads import Uploads
from keepstate.errors import BadRequest, Unauthorized

HASH = "ab" * 32


def _context(tmp_path: Path) -> Path:
    ctx = tmp_path / "ctx"
    (ctx / "app" / "sub").mkdir(parents=True)
    (ctx / "app" / "main.py").write_text("print('hi')\n")
    (ctx / "app" / "sub" / "data.bin").write_bytes(bytes(range(256)) * 10)
    os.chmod(ctx / "app" / "sub" / "data.bin", 0o640)
    (ctx / "app" / "link").symlink_to("main.py")
    (ctx / "one.txt").write_text("one\n")
    return ctx


@pytest.mark.parametrize("src", ["app", "one.txt", "app/*.py"])
@pytest.mark.parametrize("gzip", [True, False])
@pytest.mark.parametrize("resolve", [True, False])
def test_archive_hash_is_the_sdks_files_hash(tmp_path: Path, src: str, gzip: bool, resolve: bool) -> None:
    ctx = _context(tmp_path)
    expected = calculate_files_hash(src, "/home/user/", str(ctx), [], resolve, None)
    tar = tar_file_stream(src, str(ctx), [], resolve, gzip)
    data = tar.read()
    assert is_gzip(data) == gzip
    assert archive_hash(src, "/home/user/", io.BytesIO(data)) == expected
    assert archive_hash(src, "/elsewhere/", io.BytesIO(data)) != expected  # the hash covers the step itself


def test_archive_hash_sees_a_changed_file(tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    data = tar_file_stream("app", str(ctx), [], False, True).read()
    (ctx / "app" / "main.py").write_text("print('changed')\n")
    assert archive_hash("app", "/x", io.BytesIO(data)) != calculate_files_hash("app", "/x", str(ctx), [], False, None)


def _copy(**kw: object) -> dict[str, object]:
    return {"type": "COPY", "args": ["app", "/app", "", ""], "force": False, "filesHash": HASH, **kw}


def test_a_full_spec_parses() -> None:
    spec = parse_spec({"fromImage": "e2bdev/base", "force": False, "startCmd": "python -m http.server 8000",
                       "readyCmd": "curl -s localhost:8000", "steps": [
                           _copy(), {"type": "RUN", "args": ["whoami", "root"], "force": False},
                           {"type": "ENV", "args": ["A", "1", "B", "two words"], "force": False},
                           {"type": "WORKDIR", "args": ["/app"], "force": False},
                           {"type": "USER", "args": ["user"], "force": True}]})
    assert spec.parent == "base"
    assert [s.type for s in spec.steps] == ["COPY", "RUN", "ENV", "WORKDIR", "USER"]
    assert spec.steps[0].files_hash == HASH and spec.steps[4].force
    state = State()
    for s in spec.steps:
        state.apply(s)
    assert state.to_json() == {"env": {"A": "1", "B": "two words"}, "user": "user", "workdir": "/app"}


@pytest.mark.parametrize("body, words", [
    ({"steps": [{"type": "FROB", "args": []}]}, "`type` must be one of"),
    ({"steps": [_copy(filesHash=None)]}, "filesHash"),
    ({"steps": [_copy(args=["/etc/passwd", "/x"])]}, "relative to the context"),
    ({"steps": [_copy(args=["../up", "/x"])]}, "inside it"),
    ({"steps": [_copy(args=["a", "/x", "", "999"])]}, "octal mode"),
    ({"steps": [{"type": "ENV", "args": ["A"]}]}, "ENV needs"),
    ({"steps": [{"type": "RUN", "args": []}]}, "RUN needs"),
    ({"steps": [{"type": "USER", "args": ["a b"]}]}, "not a user name"),
    ({"steps": [{"type": "RUN", "args": ["true"], "filesHash": HASH}]}, "only COPY"),
    ({"fromTemplate": "a", "fromImage": "b", "steps": []}, "not both"),
    ({"steps": "RUN true"}, "`steps` must be a list"),
    ([], "JSON object"),
])
def test_bad_specs_name_the_problem(body: object, words: str) -> None:
    with pytest.raises(BadRequest, match=words):
        parse_spec(body)


def test_cache_keys_chain_on_parent_step_and_files() -> None:
    run = Step("RUN", ("echo hi",))
    copy_a, copy_b = Step("COPY", ("a", "/a", "", ""), files_hash=HASH), Step("COPY", ("a", "/a", "", ""),
                                                                              files_hash="cd" * 32)
    k1 = chain(parent_key("toml:base:d1"), [run, copy_a])
    assert k1 == chain(parent_key("toml:base:d1"), [run, copy_a])
    assert k1[0] == chain(parent_key("toml:base:d1"), [run, copy_b])[0]  # a shared prefix shares its key
    assert k1[1] != chain(parent_key("toml:base:d1"), [run, copy_b])[1]  # other files, another key
    assert k1 != chain(parent_key("toml:base:d2"), [run, copy_a])  # another parent build, all others


def test_upload_urls_are_signed_and_expire(tmp_path: Path) -> None:
    uploads = Uploads(tmp_path)
    url = uploads.url("http://127.0.0.1:9", HASH)
    query = dict(p.split("=") for p in url.split("?")[1].split("&"))
    uploads.check(HASH, query["expires"], query["signature"])
    with pytest.raises(Unauthorized, match="signature"):
        uploads.check("cd" * 32, query["expires"], query["signature"])
    with pytest.raises(Unauthorized, match="expired"):
        uploads.check(HASH, "1000", query["signature"])
    with pytest.raises(BadRequest):
        uploads.path("../../etc/passwd")
    assert Uploads(tmp_path)._key == uploads._key  # the key survives a restart
