"""kill -9 of the server, then a restart: sandboxes created before it still run commands."""

from __future__ import annotations

import os
import signal
import tempfile
import urllib.parse

from e2b import Sandbox

from sdkharness import make_key, start_server


def test_sandboxes_survive_server_sigkill(e2b_env) -> None:
    home = tempfile.mkdtemp(prefix="keepstate-restart-")
    srv = start_server(home, pool=1)
    key = make_key(home)
    opts = {"api_key": key, "api_url": srv.url, "sandbox_url": srv.url}
    port = urllib.parse.urlparse(srv.url).port
    try:
        sbx = Sandbox.create(timeout=300, **opts)
        sbx.files.write("/home/user/before.txt", "written before the crash")
        bg = sbx.commands.run("sleep 600", background=True)

        assert srv.proc is not None
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()

        srv = start_server(home, port=port, pool=1, extra=("--reap-on-exit",))
        again = Sandbox.connect(sbx.sandbox_id, **opts)
        assert again.commands.run("cat /home/user/before.txt").stdout == "written before the crash"
        assert any(p.pid == bg.pid for p in again.commands.list())
        listed = Sandbox.list(**opts).next_items()
        assert sbx.sandbox_id in {s.sandbox_id for s in listed}
        assert again.kill() is True
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            srv.proc.terminate()
            srv.proc.wait(timeout=60)
