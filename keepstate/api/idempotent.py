"""Idempotent creates (docs/design/idempotency.md): `POST /v2/sandboxes` with an `Idempotency-Key` makes at most
one sandbox however often it is retried, through whichever node, across crashes.

    creates = IdempotentCreates(db, manager, owner=lambda: node_owner("a", membership.incarnation), answer=...)
    response = await creates.run(request, api_key_id, run=lambda sandbox_id: create_it(sandbox_id))

`run` gets the sandbox ID to create (None without a key: the create chooses it).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from keepstate import faults
from keepstate.db.engine import Database
from keepstate.db.records import IdempotencyRecord
from keepstate.db.repos.idempotency import Idempotency
from keepstate.errors import BadRequest, Conflict, InProgress, KeepStateError
from keepstate.sandbox.checkpoints import new_sandbox_id
from keepstate.sandbox.manager import SandboxManager

log = logging.getLogger("keepstate.api.idempotent")

HEADER = "Idempotency-Key"
KEY = re.compile(r"[a-z0-9-]{1,255}")  # E2B's SDK's rule (e2b/retry.py)
TTL_S = 24 * 3600.0  # a key is remembered this long after its first use
IN_PROGRESS_WAIT_S = 30.0  # a retry waits this long for the first attempt before it is told to come back
POLL_S = 0.1

Run = Callable[[str | None], Awaitable[web.Response]]


def digest(request: web.Request, body: bytes) -> str:
    """The request as a key is bound to it: method, path and the body's canonical JSON (its raw bytes if it is not
    JSON: such a body gets the handler's 400 anyway)."""
    try:
        canonical = json.dumps(json.loads(body), sort_keys=True, separators=(",", ":")).encode()
    except ValueError:
        canonical = body
    return hashlib.sha256(b"%s %s\n%s" % (request.method.encode(), request.path.encode(), canonical)).hexdigest()


class IdempotentCreates:
    def __init__(self, db: Database, manager: SandboxManager, owner: Callable[[], str],
                 answer: Callable[[str], Awaitable[str | None]]) -> None:
        self.keys = Idempotency(db)
        self.m = manager
        self.owner = owner  # this server's incarnation, as the keys record it (ledger_claims.node_owner)
        self.answer = answer  # the 201 body of a recorded sandbox (None: no such sandbox)

    async def run(self, request: web.Request, api_key_id: str | None, run: Run) -> web.Response:
        key = request.headers.get(HEADER)
        if key is None:
            return await run(None)
        if not KEY.fullmatch(key):
            raise BadRequest(f"`{HEADER}` must be 1 to 255 lowercase letters, digits and hyphens")
        scope, wanted = api_key_id or "", digest(request, await request.read())
        me = self.owner()
        mine = IdempotencyRecord(api_key_id=scope, key=key, digest=wanted, sandbox_id=new_sandbox_id(),
                                 state="in_progress", owner=me)
        rec = await self.keys.begin(mine, TTL_S)
        waited_until = time.monotonic() + IN_PROGRESS_WAIT_S
        while not (rec.owner == me and rec.sandbox_id == mine.sandbox_id and rec.state == "in_progress"):
            if rec.digest != wanted:
                raise Conflict(f"idempotency key {key!r} was used for a different request (another body or route); "
                               "use a new key for a new request", error_code="idempotency_request_mismatch")
            if rec.state == "done" and rec.response is not None:
                return web.Response(text=rec.response, status=201, content_type="application/json")
            if rec.state == "unknown":
                raise Conflict(_UNKNOWN.format(key=key, sid=rec.sandbox_id), error_code="idempotency_outcome_unknown")
            if rec.owner != me and await self.keys.owner_gone(rec.owner) \
                    and await self.keys.take_over(scope, key, rec.owner, me):
                left = await self._left(rec, me)
                if left is not None:
                    return left
                mine = IdempotencyRecord(api_key_id=scope, key=key, digest=wanted, sandbox_id=rec.sandbox_id,
                                         state="in_progress", owner=me)
                break
            if time.monotonic() >= waited_until:
                raise InProgress(f"a create with idempotency key {key!r} is still in progress (sandbox "
                                 f"{rec.sandbox_id}); retry with the same key")
            await asyncio.sleep(POLL_S)
            found = await self.keys.get(scope, key)
            rec = found if found is not None else await self.keys.begin(mine, TTL_S)  # failed meanwhile: ours now
        return await self._create(mine, run)

    async def _create(self, mine: IdempotencyRecord, run: Run) -> web.Response:
        try:
            answer = await run(mine.sandbox_id)
        except BaseException:
            await _quietly(self.keys.abandon(mine.api_key_id, mine.key, mine.owner))
            raise
        if answer.status == 201 and answer.text is not None:
            faults.point("create-recorded")  # crash tests: the sandbox is recorded, its key not done, nothing answered
            if not await self.keys.finish(mine.api_key_id, mine.key, mine.owner, answer.text):
                log.warning("idempotency key %s: its record changed while the create ran", mine.key)
        else:
            await self.keys.abandon(mine.api_key_id, mine.key, mine.owner)
        return answer

    async def _left(self, rec: IdempotencyRecord, me: str) -> web.Response | None:
        """What a gone owner's attempt left (the key is `me`'s now): its sandbox's answer if it made one, a 409 if
        it made one that is gone since (its tokens with it); None if it made nothing (the create runs again)."""
        body = await self.answer(rec.sandbox_id)
        if body is not None:
            await self.keys.finish(rec.api_key_id, rec.key, me, body)
            return web.Response(text=body, status=201, content_type="application/json")
        if await self.m.recorder.lineage.session(rec.sandbox_id) is not None:
            await self.keys.finish(rec.api_key_id, rec.key, me, "", state="unknown")
            raise Conflict(_UNKNOWN.format(key=rec.key, sid=rec.sandbox_id), error_code="idempotency_outcome_unknown")
        return None

_UNKNOWN = ("the create with idempotency key {key!r} made sandbox {sid}, which is gone since, and its answer was "
            "never recorded: its outcome cannot be known; use a new key")


async def _quietly(step: Awaitable[object]) -> None:
    try:
        await step
    except (KeepStateError, OSError) as exc:  # the database is away: the key expires, or a retry takes it over
        log.warning("releasing an idempotency key: %s", exc)
