"""Pure logic of the agent, called directly (no sockets): auth, paths, modes, exit statuses, watch mapping, settings."""

from __future__ import annotations

import errno
import os
import signal
import stat
from pathlib import Path

import pytest

pytest.importorskip("keepstate.agent.entry", reason="needs the agent's own runtime dependencies")

from keepstate.agent import ENVD_VERSION  # noqa: E402
from keepstate.agent.auth import (  # noqa: E402
    EXPIRED_MESSAGE,
    AuthError,
    basic_auth_user,
    check_file_access,
    file_signature,
    token_ok,
)
from keepstate.agent.entry import (  # noqa: E402
    MetadataError,
    go_mode_string,
    read_metadata,
    replace_metadata,
    validate_metadata,
)
from keepstate.agent.metrics import parse_cpu_times, parse_meminfo  # noqa: E402
from keepstate.agent.process import exit_info  # noqa: E402
from keepstate.agent.services import INITIAL_BACKOFF_S, MAX_BACKOFF_S, next_backoff  # noqa: E402
from keepstate.agent.settings import (  # noqa: E402
    InitRequest,
    SandboxSettings,
    SettingsError,
    Template,
    load_template,
    parse_init,
    parse_template,
)
from keepstate.agent.users import BadPath, User, process_env, resolve_path  # noqa: E402
from keepstate.agent.watcher import event_type, fs_type_of  # noqa: E402
from keepstate.ports import INTERPRETER_PORT  # noqa: E402

USER = User("user", 1000, 1000, "/home/user", "/bin/bash")


def test_envd_version_is_a_version() -> None:
    assert [int(p) for p in ENVD_VERSION.split(".")] >= [0, 6, 4]


def test_signature_matches_sdk_algorithm() -> None:
    # Computed independently: base64(sha256("/a.txt:read::tok")) without padding.
    import base64
    import hashlib

    expected = "v1_" + base64.b64encode(hashlib.sha256(b"/a.txt:read::tok").digest()).decode().rstrip("=")
    assert file_signature("/a.txt", "read", None, "tok", None) == expected
    assert file_signature("/a.txt", "read", "user", "tok", 5) != expected


def test_file_access_rules() -> None:
    common = {"path": "p", "operation": "read", "user": None, "now": 100.0}
    check_file_access(token=None, header_token=None, signature=None, expiration=None, **common)
    check_file_access(token="t", header_token="t", signature=None, expiration=None, **common)
    with pytest.raises(AuthError):
        check_file_access(token="t", header_token="bad", signature=None, expiration=None, **common)
    with pytest.raises(AuthError):
        check_file_access(token="t", header_token=None, signature=None, expiration=None, **common)
    good = file_signature("p", "read", None, "t", 200)
    check_file_access(token="t", header_token=None, signature=good, expiration="200", **common)
    with pytest.raises(AuthError, match="invalid signature"):
        check_file_access(token="t", header_token=None, signature=good, expiration="201", **common)
    old = file_signature("p", "read", None, "t", 50)
    with pytest.raises(AuthError) as info:
        check_file_access(token="t", header_token=None, signature=old, expiration="50", **common)
    assert str(info.value) == EXPIRED_MESSAGE


def test_token_and_basic_auth() -> None:
    assert token_ok(None, None) and token_ok("a", "a") and not token_ok("a", None) and not token_ok("a", "b")
    assert basic_auth_user("Basic dXNlcjo=") == "user"
    assert basic_auth_user(None) is None
    with pytest.raises(AuthError):
        basic_auth_user("Basic !!!")
    with pytest.raises(AuthError):
        basic_auth_user("Bearer x")


@pytest.mark.parametrize(("given", "expected"), [
    ("", "/home/user/work"), ("~", "/home/user"), ("~/a/../b", "/home/user/b"), ("rel/x", "/home/user/rel/x"),
    ("/abs//x/./y/", "/abs/x/y"), ("../../etc", "/etc"), ("/", "/"),
])
def test_resolve_path(given: str, expected: str) -> None:
    assert resolve_path(given, USER, "/home/user/work") == expected


def test_resolve_path_rejects_nul_and_defaults_to_home() -> None:
    with pytest.raises(BadPath):
        resolve_path("a\x00b", USER)
    assert resolve_path("", USER) == "/home/user"


def test_process_env_precedence() -> None:
    env = process_env(USER, {"A": "sandbox", "B": "sandbox"}, {"B": "request"})
    assert (env["HOME"], env["USER"], env["LOGNAME"], env["A"], env["B"]) == (
        "/home/user", "user", "user", "sandbox", "request")
    assert "/usr/bin" in env["PATH"]


@pytest.mark.parametrize(("mode", "text"), [
    (stat.S_IFREG | 0o644, "-rw-r--r--"), (stat.S_IFDIR | 0o755, "drwxr-xr-x"), (stat.S_IFLNK | 0o777, "Lrwxrwxrwx"),
    (stat.S_IFDIR | stat.S_ISVTX | 0o777, "dtrwxrwxrwx"), (stat.S_IFREG | stat.S_ISUID | 0o755, "urwxr-xr-x"),
    (stat.S_IFCHR | 0o666, "Dcrw-rw-rw-"), (stat.S_IFIFO | 0o600, "prw-------"),
])
def test_go_mode_string(mode: int, text: str) -> None:
    assert go_mode_string(mode) == text


def test_metadata_validation() -> None:
    validate_metadata({"k": "v"})
    for bad in ({"": "v"}, {"k": "caf\u00e9"}, {"k" * 247: "v"}, {"k": "v" * 5000}):
        with pytest.raises(MetadataError):
            validate_metadata(bad)


def test_metadata_is_replaced_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f"
    path.write_text("x")
    fd = os.open(path, os.O_RDWR)
    try:
        try:
            replace_metadata(fd, {"a": "1", "b": "2"})
        except OSError as e:
            if e.errno == errno.ENOTSUP:
                pytest.skip(f"{tmp_path} has no user xattrs")
            raise
        assert read_metadata(str(path)) == {"a": "1", "b": "2"}
        replace_metadata(fd, {"b": "3"})
        assert read_metadata(str(path)) == {"b": "3"}
        replace_metadata(fd, {})
        assert read_metadata(str(path)) == {}

        def no_xattrs(_: int) -> list[str]:
            raise OSError(errno.ENOTSUP, "Operation not supported")

        monkeypatch.setattr(os, "listxattr", no_xattrs)
        replace_metadata(fd, {})  # nothing to clear where there can be none: the upload still succeeds
        with pytest.raises(OSError):
            replace_metadata(fd, {"a": "1"})  # but metadata asked for and not stored is an error
    finally:
        os.close(fd)


def test_exit_info_like_go() -> None:
    ok = exit_info(0)
    assert (ok.exit_code, ok.exited, ok.status, ok.error) == (0, True, "exit status 0", None)
    failed = exit_info(3 << 8)
    assert (failed.exit_code, failed.status, failed.error) == (3, "exit status 3", "exit status 3")
    killed = exit_info(signal.SIGKILL)
    assert (killed.exit_code, killed.exited, killed.status) == (-1, False, "signal: killed")
    assert exit_info(signal.SIGTERM).status == "signal: terminated"


def test_inotify_mapping() -> None:
    from inotify_simple import flags as F

    from keepstate.agent.proto.filesystem.filesystem_pb import EventType

    assert event_type(F.CREATE | F.ISDIR) == EventType.CREATE
    assert event_type(F.MOVED_TO) == EventType.CREATE
    assert event_type(F.MOVED_FROM) == EventType.RENAME
    assert event_type(F.MODIFY) == EventType.WRITE
    assert event_type(F.DELETE) == EventType.REMOVE
    assert event_type(F.ATTRIB) == EventType.CHMOD
    assert event_type(F.OPEN) is None


def test_fs_type_longest_mount_wins() -> None:
    mounts = "none / 9p rw 0 0\nsrv:/x /mnt/nfs nfs4 rw 0 0\nfoo /mnt/nfs/local ext4 rw 0 0\n"
    assert fs_type_of("/home/user", mounts) == "9p"
    assert fs_type_of("/mnt/nfs/data", mounts) == "nfs4"
    assert fs_type_of("/mnt/nfs/local/x", mounts) == "ext4"
    assert fs_type_of("/mnt/nfsother", mounts) == "9p"


def test_template_parsing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert load_template(tmp_path / "missing.json") == Template()
    t = parse_template({"user": "user", "workdir": "/home/user", "env": {"A": "1"},
                        "services": [{"name": "ci", "command": ["python3", "-m", "x"], "port": INTERPRETER_PORT}]})
    assert (t.user, t.services[0].user, t.services[0].port) == ("user", "root", INTERPRETER_PORT)
    with pytest.raises(SettingsError):
        parse_template({"services": [{"name": "x", "command": []}]})
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SettingsError):
        load_template(tmp_path / "bad.json")


def test_init_applies_and_merges() -> None:
    settings = SandboxSettings(Template(user="user", env={"T": "template"}))
    assert settings.access_token is None
    settings.apply(parse_init({"accessToken": "tok", "envVars": {"A": "1"}, "defaultUser": "root",
                               "defaultWorkdir": "/srv", "timestamp": "2026-01-01T00:00:00Z"}))
    assert (settings.access_token, settings.default_user, settings.default_workdir) == ("tok", "root", "/srv")
    assert settings.env_vars == {"T": "template", "A": "1"}
    settings.apply(InitRequest(access_token="", env_vars={}, default_user=None, default_workdir=None))
    assert settings.access_token is None and settings.default_user == "root"
    with pytest.raises(SettingsError):
        parse_init({"accessToken": 5})


def test_backoff_grows_caps_and_resets() -> None:
    b = INITIAL_BACKOFF_S
    for _ in range(20):
        b = next_backoff(b, 0.1)
    assert b == MAX_BACKOFF_S
    assert next_backoff(b, 3600) == INITIAL_BACKOFF_S


def test_metrics_parsers() -> None:
    busy, total = parse_cpu_times("cpu  10 0 10 70 10 0 0 0 0 0\ncpu0 1 1 1 1\n")
    assert (busy, total) == (20, 100)
    mem = parse_meminfo("MemTotal:       2048 kB\nMemAvailable:   1024 kB\nHugePages_Total: 0\n")
    assert mem == {"MemTotal": 2048 * 1024, "MemAvailable": 1024 * 1024, "HugePages_Total": 0}
    assert os.cpu_count()


def test_upload_error_mapping() -> None:
    import errno

    from keepstate.agent.files_http import _accepts_gzip, _write_error

    assert _write_error(OSError(errno.ENOSPC, "No space left on device"), "/x").status == 507
    assert _write_error(OSError(errno.EISDIR, "Is a directory"), "/x").status == 400
    assert _write_error(OSError(errno.EACCES, "Permission denied"), "/x").status == 403
    assert _accepts_gzip("gzip, deflate") and _accepts_gzip("br;q=1, *") and not _accepts_gzip("gzip;q=0")
    assert not _accepts_gzip(None)


def test_user_and_group_lookups_are_kept_while_their_files_are_unchanged(tmp_path, monkeypatch) -> None:
    """users.group_list / lookup_user: ~1 ms each under gVisor, so answers are kept until /etc/group (or passwd,
    or nsswitch.conf) changes; a changed file is read again."""
    import os

    from keepstate.agent import users

    group_file = tmp_path / "group"
    group_file.write_text("one\n")
    monkeypatch.setattr(users, "_DATABASES", {"passwd": (str(tmp_path / "passwd"),), "group": (str(group_file),)})
    monkeypatch.setattr(users, "_cache", {})
    calls: list[tuple[str, int]] = []
    answers = iter([[1000], [1000, 27]])

    def getgrouplist(name: str, gid: int) -> list[int]:
        calls.append((name, gid))
        return next(answers)

    monkeypatch.setattr(os, "getgrouplist", getgrouplist)
    assert users.group_list("user", 1000) == [1000]
    assert users.group_list("user", 1000) == [1000]
    assert len(calls) == 1
    group_file.write_text("one, with sudo now\n")  # usermod -aG: another size, mtime and ctime
    assert users.group_list("user", 1000) == [1000, 27]
    assert len(calls) == 2
    root = users.lookup_user("root")
    assert root.uid == 0 and users.lookup_user("root") is root
    with pytest.raises(users.UnknownUser):
        users.lookup_user("no-such-user-here")
