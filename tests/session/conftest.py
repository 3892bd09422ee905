"""Fixtures for the session tests: an event log on a new database (SQLite and PostgreSQL), golden histories, a local
executor."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from keepstate.db.engine import Database
from keepstate.session import Event, EventLog, Lineage
from keepstate.testing.databases import database, db_url, postgres  # noqa: F401

GOLDEN = Path(__file__).parent / "golden"
SANDBOX_HOME = "/home/user"


@pytest.fixture
def log(database: Database) -> EventLog:  # noqa: F811
    return EventLog(database)


@pytest.fixture
def lineage(log: EventLog) -> Lineage:
    return Lineage(log.history)


def load_golden(name: str) -> list[Event]:
    return [Event.from_dict(d) for d in json.loads((GOLDEN / name).read_text())]


class LocalExecutor:
    """Runs replayed steps as real local processes in a scratch directory standing in for the sandbox's /.

    Recorded absolute paths under /home/user are remapped into the scratch directory; users are not switched.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / SANDBOX_HOME.lstrip("/")).mkdir(parents=True, exist_ok=True)
        self.calls: list[tuple[str, list[str], str | None, str | None]] = []

    def _map(self, path: str) -> str:
        return str(self.root / path.lstrip("/")) if path.startswith(SANDBOX_HOME) else path

    def run(self, cmd: str, args: list[str], cwd: str | None, user: str | None, envs: dict[str, str]) -> int:
        self.calls.append((cmd, args, cwd, user))
        mapped = [self._map(a) for a in args]
        workdir = self._map(cwd or SANDBOX_HOME)
        proc = subprocess.run([cmd, *mapped], cwd=workdir, env={**os.environ, **envs}, capture_output=True,
                              timeout=30)
        return proc.returncode

    def write(self, path: str, data: bytes, user: str | None) -> None:
        target = Path(self._map(path))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


TOKEN = "agent-token"


@dataclass
class FakeJournal:
    """The agent's bounded journal: holds entries from `oldest` on; earlier ones were dropped."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    dropped: int = 0
    requests: list[dict[str, str]] = field(default_factory=list)
    fail: bool = False

    def add(self, kind: str, **data: Any) -> None:
        seq = self.dropped + len(self.entries) + 1
        self.entries.append({"seq": seq, "ts": 1000.0 + seq, "kind": kind, "data": data})

    def drop_oldest(self, n: int) -> None:
        self.entries = self.entries[n:]
        self.dropped += n

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append(dict(request.query))
        if request.headers.get("X-Access-Token") != TOKEN:
            return web.json_response({"code": 401, "message": "bad token"}, status=401)
        if self.fail:
            return web.json_response({"code": 500, "message": "boom"}, status=500)
        after, limit = int(request.query["after"]), int(request.query["limit"])
        page = [e for e in self.entries if e["seq"] > after][:limit]
        return web.json_response({"events": page, "next": page[-1]["seq"] if page else after,
                                  "oldest": self.dropped + 1, "last": self.dropped + len(self.entries)})


@pytest.fixture
async def agent() -> AsyncIterator[tuple[FakeJournal, str]]:
    journal = FakeJournal()
    app = web.Application()
    app.router.add_get("/journal", journal.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield journal, f"http://127.0.0.1:{port}"
    await runner.cleanup()
