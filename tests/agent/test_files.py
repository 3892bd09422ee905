"""Files through the stock SDK: read/write in every shape, listing, stat, dirs, rename, remove, metadata, URLs."""

from __future__ import annotations

import io
import os
import time

import httpx
import pytest
from e2b import FileType, InvalidArgumentException, NotFoundException


def test_write_read_text(sandbox, home_dir) -> None:
    path = f"{home_dir}/hello.txt"
    info = sandbox.files.write(path, "Hello, world!")
    assert info.path == path
    assert info.name == "hello.txt"
    assert sandbox.files.read(path) == "Hello, world!"
    entry = sandbox.files.get_info(path)
    assert (entry.type, entry.size, entry.mode, entry.permissions) == (FileType.FILE, 13, 0o644, "-rw-r--r--")
    assert (entry.owner, entry.group) == ("user", "user")
    assert entry.modified_time.tzinfo is not None


def test_relative_path_is_under_home(sandbox, home_dir) -> None:
    rel = os.path.basename(home_dir) + "/rel.txt"
    info = sandbox.files.write(rel, "x")
    assert info.path == f"{home_dir}/rel.txt"
    assert sandbox.files.read(f"~/{rel}") == "x"


def test_bytes_and_gzip_roundtrip(sandbox, home_dir) -> None:
    data = bytes(range(256)) * 1000
    sandbox.files.write(f"{home_dir}/b.bin", data)
    assert sandbox.files.read(f"{home_dir}/b.bin", format="bytes") == data
    sandbox.files.write(f"{home_dir}/g.bin", data, gzip=True)
    assert sandbox.files.read(f"{home_dir}/g.bin", format="bytes", gzip=True) == data


def test_streamed_write_and_read(sandbox, home_dir) -> None:
    payload = os.urandom(3 * 1024 * 1024 + 17)
    sandbox.files.write(f"{home_dir}/big.bin", io.BytesIO(payload))
    stream = sandbox.files.read(f"{home_dir}/big.bin", format="stream")
    assert b"".join(stream) == payload


def test_write_files_multipart_full_paths(sandbox, home_dir) -> None:
    infos = sandbox.files.write_files([
        {"path": f"{home_dir}/a/one.txt", "data": "1"},
        {"path": f"{home_dir}/b/c/two.txt", "data": b"22"},
    ])
    assert [i.path for i in infos] == [f"{home_dir}/a/one.txt", f"{home_dir}/b/c/two.txt"]
    assert sandbox.files.read(f"{home_dir}/b/c/two.txt") == "22"
    assert sandbox.files.get_info(f"{home_dir}/b/c").owner == "user"
    assert sandbox.files.get_info(f"{home_dir}/b/c").permissions == "drwxr-xr-x"


def test_write_as_root(sandbox) -> None:
    path = f"/tmp/agent-root-{time.monotonic_ns()}.txt"
    try:
        sandbox.files.write(path, "r", user="root")
        assert sandbox.files.get_info(path, user="root").owner == "root"
    finally:
        sandbox.files.remove(path, user="root")


def test_read_missing_raises(sandbox, home_dir) -> None:
    from e2b import FileNotFoundException

    with pytest.raises(FileNotFoundException):
        sandbox.files.read(f"{home_dir}/nope.txt")


def test_read_directory_is_invalid(sandbox, home_dir) -> None:
    sandbox.files.make_dir(home_dir)
    with pytest.raises(InvalidArgumentException):
        sandbox.files.read(home_dir)


def test_list_depth_and_order(sandbox, home_dir) -> None:
    for p in ("b.txt", "a/x.txt", "a/deep/y.txt", "c/z.txt"):
        sandbox.files.write(f"{home_dir}/{p}", p)
    names = [e.path.removeprefix(home_dir + "/") for e in sandbox.files.list(home_dir)]
    assert names == ["a", "b.txt", "c"]
    names = [e.path.removeprefix(home_dir + "/") for e in sandbox.files.list(home_dir, depth=3)]
    assert names == ["a", "a/deep", "a/deep/y.txt", "a/x.txt", "b.txt", "c", "c/z.txt"]
    with pytest.raises(InvalidArgumentException):
        sandbox.files.list(f"{home_dir}/b.txt")
    with pytest.raises(NotFoundException):
        sandbox.files.list(f"{home_dir}/missing")


def test_exists_make_dir_rename_remove(sandbox, home_dir) -> None:
    assert sandbox.files.exists(home_dir) is False
    assert sandbox.files.make_dir(f"{home_dir}/x/y") is True
    assert sandbox.files.make_dir(f"{home_dir}/x/y") is False
    assert sandbox.files.get_info(f"{home_dir}/x").type == FileType.DIR
    sandbox.files.write(f"{home_dir}/x/f.txt", "f")
    moved = sandbox.files.rename(f"{home_dir}/x/f.txt", f"{home_dir}/new/dir/g.txt")
    assert moved.path == f"{home_dir}/new/dir/g.txt"
    assert sandbox.files.exists(f"{home_dir}/x/f.txt") is False
    with pytest.raises(NotFoundException):
        sandbox.files.rename(f"{home_dir}/x/f.txt", f"{home_dir}/z.txt")
    sandbox.files.remove(f"{home_dir}/new")
    assert sandbox.files.exists(f"{home_dir}/new") is False
    sandbox.files.remove(f"{home_dir}/new")  # removing what is gone is fine


def test_symlink_reports_target(sandbox, home_dir) -> None:
    sandbox.files.write(f"{home_dir}/target.txt", "t")
    sandbox.commands.run(f"ln -s {home_dir}/target.txt {home_dir}/link")
    info = sandbox.files.get_info(f"{home_dir}/link")
    assert info.symlink_target == f"{home_dir}/target.txt"
    assert info.type == FileType.FILE


def test_metadata_roundtrip(sandbox, home_dir) -> None:
    if "metadata" not in sandbox.files.write.__code__.co_varnames:
        pytest.skip("this SDK has no file metadata")
    info = sandbox.files.write(f"{home_dir}/m.txt", "m", metadata={"Owner": "alice", "kind": "report"})
    assert info.metadata == {"owner": "alice", "kind": "report"}
    assert sandbox.files.get_info(f"{home_dir}/m.txt").metadata == {"owner": "alice", "kind": "report"}
    sandbox.files.write(f"{home_dir}/m.txt", "m2", metadata={"kind": "draft"})
    assert sandbox.files.get_info(f"{home_dir}/m.txt").metadata == {"kind": "draft"}
    out = sandbox.commands.run(f"getfattr -n user.e2b.kind --only-values {home_dir}/m.txt || true")
    assert out.stdout in ("draft", "")  # getfattr may be missing on the dev host


@pytest.mark.parametrize("use_octet_stream", [False, True], ids=["multipart", "octet-stream"])
def test_rewrite_without_metadata_clears_it(sandbox, home_dir, use_octet_stream: bool) -> None:
    # E2B: each upload sets the file's whole metadata, so an upload without any leaves the file with none.
    if "metadata" not in sandbox.files.write.__code__.co_varnames:
        pytest.skip("this SDK has no file metadata")
    path = f"{home_dir}/m.txt"
    sandbox.files.write(path, "v1", metadata={"owner": "alice"}, use_octet_stream=use_octet_stream)
    assert sandbox.files.get_info(path).metadata == {"owner": "alice"}
    info = sandbox.files.write(path, "v2", use_octet_stream=use_octet_stream)
    assert info.metadata is None
    assert sandbox.files.get_info(path).metadata is None
    assert [(e.name, e.metadata) for e in sandbox.files.list(home_dir)] == [("m.txt", None)]
    assert sandbox.files.read(path) == "v2"


def test_signed_download_and_upload_urls(sandbox, home_dir) -> None:
    sandbox.files.write(f"{home_dir}/s.txt", "signed")
    url = sandbox.download_url(f"{home_dir}/s.txt")
    assert "signature=v1_" in url
    r = httpx.get(url)
    assert (r.status_code, r.text) == (200, "signed")
    up = sandbox.upload_url(f"{home_dir}/u.txt")
    r = httpx.post(up, files={"file": ("u.txt", b"uploaded")})
    assert r.status_code == 200, r.text
    assert r.json()[0]["path"] == f"{home_dir}/u.txt"
    assert sandbox.files.read(f"{home_dir}/u.txt") == "uploaded"
    tampered = url.replace("signature=v1_", "signature=v1_x")
    assert httpx.get(tampered).status_code == 401


def test_signed_url_expired(sandbox, home_dir) -> None:
    sandbox.files.write(f"{home_dir}/e.txt", "e")
    url = sandbox.download_url(f"{home_dir}/e.txt", use_signature_expiration=-10)
    r = httpx.get(url)
    assert r.status_code == 401
    assert r.json() == {"code": 401, "message": "signature is already expired"}
    fresh = sandbox.download_url(f"{home_dir}/e.txt", use_signature_expiration=120)
    assert httpx.get(fresh).text == "e"


async def test_async_files(async_sandbox, home_dir) -> None:
    files = async_sandbox.files
    await files.write(f"{home_dir}/a.txt", "async")
    assert await files.read(f"{home_dir}/a.txt") == "async"
    assert await files.exists(f"{home_dir}/a.txt")
    assert await files.make_dir(f"{home_dir}/d") is True
    entries = await files.list(home_dir)
    assert [e.name for e in entries] == ["a.txt", "d"]
    await files.rename(f"{home_dir}/a.txt", f"{home_dir}/d/b.txt")
    assert (await files.get_info(f"{home_dir}/d/b.txt")).size == 5
    await files.remove(f"{home_dir}/d")
    assert not await files.exists(f"{home_dir}/d")
