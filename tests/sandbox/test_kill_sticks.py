"""A kill of a paused sandbox is final: its pause checkpoint is still in the store (the store's gc collects it),
but the database, which is the authority, says the session was killed, so a later connect is a 404 and does not
bring it back from the store."""

from __future__ import annotations

from pathlib import Path

from .conftest import serving


async def test_a_killed_paused_sandbox_does_not_come_back_from_the_store(tmp_path: Path) -> None:
    async with serving(store_url=f"file://{tmp_path / 'store'}", pool_size=0) as s:
        status, made = await s.call("POST", "/sandboxes", {"templateID": "base", "timeout": 300})
        assert status == 201, made
        sid = made["sandboxID"]
        assert (await s.call("POST", f"/sandboxes/{sid}/pause"))[0] == 204
        assert s.manager.checkpoints.paused_row(sid) is not None  # what a connect could load it from
        assert (await s.call("DELETE", f"/sandboxes/{sid}"))[0] == 204
        status, body = await s.call("POST", f"/sandboxes/{sid}/connect", {"timeout": 60})
        assert status == 404, body
        status, _ = await s.call("GET", f"/sandboxes/{sid}")
        assert status == 404
