"""The selected user's file permissions: the pure rule, then /files and the filesystem RPCs through the SDK."""

from __future__ import annotations

import uuid

import pytest
from e2b import SandboxException


def test_permission_rule() -> None:
    perms = pytest.importorskip("keepstate.agent.permissions")
    user = perms.Identity("user", 1000, frozenset({1000, 27}))
    root = perms.Identity("root", 0, frozenset({0}))
    R, W, X = perms.R, perms.W, perms.X
    assert perms.allowed(0o640, 0, 0, user, R) is False  # /etc/shadow
    assert perms.allowed(0o640, 0, 0, root, R | W) is True
    assert perms.allowed(0o640, 0, 27, user, R) is True  # via a supplementary group
    assert perms.allowed(0o640, 0, 27, user, W) is False
    assert perms.allowed(0o077, 1000, 1000, user, R) is False  # the owner class alone applies
    assert perms.allowed(0o755, 0, 0, user, R | X) is True
    assert perms.allowed(0o755, 0, 0, user, W | X) is False
    assert perms.sticky_allows(0o1777, 0, 1000, user) is True
    assert perms.sticky_allows(0o1777, 0, 0, user) is False
    assert perms.sticky_allows(0o777, 0, 0, user) is True
    assert perms.sticky_allows(0o1777, 1000, 0, user) is True


@pytest.fixture
def root_files(sandbox):  # type: ignore[no-untyped-def]
    """A root-owned tree in /tmp: a private dir, a 0600 file, a 0644 file (removed afterwards)."""
    base = f"/tmp/perm-{uuid.uuid4().hex[:8]}"
    sandbox.commands.run(
        f"mkdir -p {base}/private && chmod 700 {base}/private && echo s > {base}/private/inner && "
        f"echo secret > {base}/secret && chmod 600 {base}/secret && echo pub > {base}/public && "
        f"chmod 755 {base}", user="root")
    yield base
    sandbox.commands.run(f"rm -rf {base}", user="root")


def _denied(call) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(SandboxException) as info:
        call()
    text = str(info.value)
    assert "permission denied" in text, text
    return text


def test_read_enforces_user_permissions(sandbox, root_files) -> None:
    assert "may not read" in _denied(lambda: sandbox.files.read(f"{root_files}/secret", user="user"))
    assert sandbox.files.read(f"{root_files}/secret", user="root") == "secret\n"
    assert sandbox.files.read(f"{root_files}/public", user="user") == "pub\n"
    assert "may not enter" in _denied(lambda: sandbox.files.read(f"{root_files}/private/inner", user="user"))
    _denied(lambda: sandbox.files.read("/etc/shadow", user="user"))


def test_write_enforces_user_permissions(sandbox, root_files, home_dir) -> None:
    _denied(lambda: sandbox.files.write(f"{root_files}/public", "overwritten", user="user"))
    assert "create entries in" in _denied(lambda: sandbox.files.write(f"{root_files}/new/deep.txt", "x", user="user"))
    assert sandbox.files.read(f"{root_files}/public", user="root") == "pub\n"
    assert not sandbox.files.exists(f"{root_files}/new", user="root")
    # Where the user may write, created files still belong to the user.
    info = sandbox.files.write(f"{home_dir}/mine/ok.txt", "ok", user="user")
    assert sandbox.files.get_info(info.path).owner == "user"
    sandbox.files.write(f"{root_files}/new/deep.txt", "root may", user="root")


def test_rpcs_enforce_user_permissions(sandbox, root_files, home_dir) -> None:
    files = sandbox.files
    _denied(lambda: files.list(f"{root_files}/private", user="user"))
    assert [e.name for e in files.list(f"{root_files}/private", user="root")] == ["inner"]
    _denied(lambda: files.get_info(f"{root_files}/private/inner", user="user"))
    _denied(lambda: files.make_dir(f"{root_files}/newdir", user="user"))
    _denied(lambda: files.remove(f"{root_files}/public", user="user"))
    assert files.exists(f"{root_files}/public", user="root")
    files.write(f"{home_dir}/moving.txt", "m")
    _denied(lambda: files.rename(f"{home_dir}/moving.txt", f"{root_files}/moved.txt", user="user"))
    _denied(lambda: files.rename(f"{root_files}/public", f"{home_dir}/stolen.txt", user="user"))
    # /tmp is sticky: the user may not remove root's file there even though /tmp is world-writable.
    _denied(lambda: files.remove(root_files, user="user"))
    _denied(lambda: files.watch_dir(f"{root_files}/private", user="user"))
    _denied(lambda: sandbox.commands.run("pwd", cwd=f"{root_files}/private", user="user"))
    assert sandbox.commands.run("pwd", cwd=f"{root_files}/private", user="root").stdout.strip() == \
        f"{root_files}/private"


def test_http_refusal_is_json_403(sandbox, root_files) -> None:
    from tests.agent.harness import wire_of

    http = wire_of(sandbox).client(authed=True)
    r = http.get("/files", params={"path": f"{root_files}/secret", "username": "user"})
    assert r.status_code == 403
    assert r.json() == {"code": 403, "message": f"permission denied: user 'user' may not read '{root_files}/secret'"}
