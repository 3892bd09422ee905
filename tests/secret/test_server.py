"""`keepstate serve` and its secrets key: values survive a restart and still decrypt; the key can come from
`--secrets-key-file` or KEEPSTATE_SECRETS_KEY; a server given another key refuses to start, saying why, without
the key or a value in what it says. Real servers (no sandboxes: none is needed), the stock SDK."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import stat
import subprocess
import tempfile
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Secret

from keepstate.db.engine import Database
from keepstate.db.setup import db_url
from keepstate.secret import SecretStore
from keepstate.secret.crypto import ENV_VAR
from tests.sdk.sdkharness import Server, make_key, start_server

EXTRA = ("--warm", "", "--reap-on-exit")


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for srv in started:
        if srv.proc is not None and srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGTERM)
            srv.proc.wait(timeout=60)


@pytest.fixture(autouse=True)
def no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("KEEPSTATE_VALIDATE_RESPONSES", "1")


def start(servers: list[Server], home: str, port: int | None = None, extra: tuple[str, ...] = ()) -> Server:
    srv = start_server(home, port=port, pool=0, extra=(*EXTRA, *extra))
    srv.key = make_key(home)
    servers.append(srv)
    return srv


def stop(srv: Server) -> None:
    assert srv.proc is not None
    srv.proc.terminate()
    srv.proc.wait(timeout=120)


def opts(srv: Server) -> dict[str, str]:
    return {"api_key": srv.key, "api_url": srv.url}


def stored_value(home: str, key_file: Path, name: str) -> str | None:
    """The value the server's database holds for `name`, opened with `key_file` (a store of this process's own)."""

    async def main() -> str | None:
        db = await Database.open(db_url(Path(home)))
        try:
            store = SecretStore.open(db, key_file)
            await store.check_key()
            return await store.value(name)
        finally:
            await db.close()

    return asyncio.run(main())


def test_values_survive_a_restart_and_still_decrypt(servers: list[Server]) -> None:
    home = tempfile.mkdtemp(prefix="keepstate-secret-restart-")
    srv = start(servers, home)
    made = Secret.create("Kept", "value-one", metadata={"a": "b"}, **opts(srv))
    Secret.update("kept", "value-two", **opts(srv))
    key_file = Path(home) / "secrets.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and len(key_file.read_bytes()) == 32
    stop(srv)
    srv = start(servers, home, port=urllib.parse.urlparse(srv.url).port)
    info = Secret.get_info("KEPT", **opts(srv))
    assert (info.secret_id, info.version, info.metadata) == (made.secret_id, 2, {"a": "b"})
    stop(srv)
    # What the egress proxy will read: the current version's value, decrypted on the host.
    assert stored_value(home, key_file, "kept") == "value-two"


def test_the_key_from_a_file_option_or_the_environment(servers: list[Server], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    home = tempfile.mkdtemp(prefix="keepstate-secret-keyfile-")
    key_file = tmp_path / "elsewhere" / "ks.key"
    srv = start(servers, home, extra=("--secrets-key-file", str(key_file)))
    Secret.create("in-file", "file-value", **opts(srv))
    stop(srv)
    assert key_file.exists() and not (Path(home) / "secrets.key").exists()
    assert stored_value(home, key_file, "in-file") == "file-value"

    env_home = tempfile.mkdtemp(prefix="keepstate-secret-envkey-")
    key = os.urandom(32)
    monkeypatch.setenv(ENV_VAR, base64.b64encode(key).decode())
    srv = start(servers, env_home)
    Secret.create("in-env", "env-value", **opts(srv))
    stop(srv)
    assert not (Path(env_home) / "secrets.key").exists()  # the environment's key: no file made
    (tmp_path / "env.key").write_bytes(key)
    monkeypatch.delenv(ENV_VAR)
    assert stored_value(env_home, tmp_path / "env.key", "in-env") == "env-value"


def test_a_server_given_another_key_refuses_to_start(servers: list[Server], monkeypatch: pytest.MonkeyPatch) -> None:
    home = tempfile.mkdtemp(prefix="keepstate-secret-wrongkey-")
    srv = start(servers, home)
    Secret.create("guarded", "guarded-value", **opts(srv))
    stop(srv)
    other = base64.b64encode(os.urandom(32)).decode()
    monkeypatch.setenv(ENV_VAR, other)
    log = Path(home) / "server.log"
    before = log.stat().st_size
    with pytest.raises(RuntimeError, match="exited with"):
        start_server(home, pool=0, extra=EXTRA)
    said = log.read_bytes()[before:].decode(errors="replace")
    assert "secrets key is not the one the 1 secret(s)" in said and "--secrets-key-file" in said, said
    assert "Traceback" not in said and other not in said and "guarded-value" not in said, said
    monkeypatch.delenv(ENV_VAR)
    srv = start(servers, home)  # the right key again: all is there
    assert Secret.get_info("guarded", **opts(srv)).version == 1


def test_serve_documents_the_key_option() -> None:
    from tests.sdk.sdkharness import KEEPSTATE

    out = subprocess.run([str(KEEPSTATE), "serve", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "--secrets-key-file" in out and ENV_VAR in out
