"""REST handlers for E2B's volumes (docs/design/volumes.md): the control routes `/volumes` (API key, like every
control route) and the content routes `/volumecontent/{volumeID}/...` (the volume's bearer token, never the API
key; app.py's dispatch lets them through without one). File bodies are streamed both ways.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from keepstate.errors import BadRequest, KeepStateError
from keepstate.volume import VolumeRecord, Volumes

from . import schemas
from .control import manager
from .keys import VOLUMES

routes = web.RouteTableDef()
CONTENT_PREFIX = "/volumecontent/"
CHUNK = 256 << 10
DRAIN_LIMIT = 64 << 20  # a refused upload up to this size is read to its end, so the client sees our answer


def volumes(request: web.Request) -> Volumes:
    return request.app[VOLUMES]


def _info(vol: VolumeRecord, token: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"volumeID": vol.volume_id, "name": vol.name}
    if token:
        out["token"] = vol.token
    return out


# -- control ---------------------------------------------------------------------------------------------------
@routes.post("/volumes")
async def create(request: web.Request) -> web.Response:
    body = schemas.parse_object(await request.read())
    store = volumes(request)
    name, size_mb = store.check_new(body.get("name"), body.get("sizeMB"))
    vol = await store.create(name, size_mb)
    return web.json_response(_info(vol, token=True), status=201)


@routes.get("/volumes")
async def list_volumes(request: web.Request) -> web.Response:
    return web.json_response([_info(v, token=False) for v in await volumes(request).list()])


@routes.get("/volumes/{volume_id}")
async def get_volume(request: web.Request) -> web.Response:
    return web.json_response(_info(await volumes(request).get(request.match_info["volume_id"]), token=True))


@routes.delete("/volumes/{volume_id}")
async def destroy(request: web.Request) -> web.Response:
    """Refused (409) while a sandbox mounts it; else the row goes first (new calls: 404), then, once no content
    call runs any more, the data."""
    store, volume_id = volumes(request), request.match_info["volume_id"]
    await store.forget(volume_id, lambda: manager(request).table.volume_users(volume_id))
    await store.gate(volume_id).close()
    await asyncio.to_thread(store.remove, volume_id)
    return web.Response(status=204)


# -- content ---------------------------------------------------------------------------------------------------
def _owner(query: Mapping[str, str]) -> tuple[int | None, int | None, int | None]:
    return (schemas.query_int(query, "uid", None, 0, 2**32 - 2), schemas.query_int(query, "gid", None, 0, 2**32 - 2),
            schemas.query_int(query, "mode", None, 0, 0o7777))


def _path(request: web.Request) -> str:
    if "path" not in request.query:
        raise BadRequest("query parameter `path` is required (a path inside the volume, e.g. /dir/file.txt)")
    return request.query["path"]


async def _authorized(request: web.Request) -> tuple[Volumes, VolumeRecord]:
    store = volumes(request)
    return store, await store.authorize(request.match_info["volume_id"], request.headers.get("Authorization"))


@routes.get("/volumecontent/{volume_id}/dir")
async def list_dir(request: web.Request) -> web.Response:
    store, vol = await _authorized(request)
    path, depth = _path(request), schemas.query_int(request.query, "depth", 1, 1, 16)
    async with store.gate(vol.volume_id).shared():
        entries = await asyncio.to_thread(store.root(vol).listdir, path, depth)
    return web.json_response(entries)


@routes.post("/volumecontent/{volume_id}/dir")
async def make_dir(request: web.Request) -> web.Response:
    store, vol = await _authorized(request)
    path, (uid, gid, mode), force = _path(request), _owner(request.query), schemas.query_bool(request.query, "force")
    async with store.gate(vol.volume_id).shared():
        entry = await asyncio.to_thread(store.root(vol).mkdir, path, uid, gid, mode, force)
    return web.json_response(entry, status=201)


@routes.get("/volumecontent/{volume_id}/path")
async def stat_path(request: web.Request) -> web.Response:
    store, vol = await _authorized(request)
    path = _path(request)
    async with store.gate(vol.volume_id).shared():
        entry = await asyncio.to_thread(store.root(vol).stat, path)
    return web.json_response(entry)


@routes.patch("/volumecontent/{volume_id}/path")
async def update_path(request: web.Request) -> web.Response:
    store, vol = await _authorized(request)
    path, body = _path(request), schemas.parse_object(await request.read())
    owner = []
    for name, high in (("uid", 2**32 - 2), ("gid", 2**32 - 2), ("mode", 0o7777)):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high):
            raise BadRequest(f"`{name}` must be a whole number from 0 to {high}")
        owner.append(value)
    async with store.gate(vol.volume_id).shared():
        entry = await asyncio.to_thread(store.root(vol).chattr, path, *owner)
    return web.json_response(entry)


@routes.delete("/volumecontent/{volume_id}/path")
async def remove_path(request: web.Request) -> web.Response:
    store, vol = await _authorized(request)
    path = _path(request)
    async with store.gate(vol.volume_id).shared():
        await asyncio.to_thread(store.root(vol).remove, path)
    return web.Response(status=204)


@routes.get("/volumecontent/{volume_id}/file")
async def read_file(request: web.Request) -> web.StreamResponse:
    store, vol = await _authorized(request)
    path = _path(request)
    async with store.gate(vol.volume_id).shared():
        fd, size = await asyncio.to_thread(store.root(vol).open_file, path)
        try:
            response = web.StreamResponse(status=200, headers={"Content-Type": "application/octet-stream"})
            response.content_length = size
            await response.prepare(request)
            sent = 0
            while sent < size:  # the size when opened: a file growing meanwhile is sent as it was
                chunk = await asyncio.to_thread(os.read, fd, min(CHUNK, size - sent))
                if not chunk:
                    break
                await response.write(chunk)
                sent += len(chunk)
            await response.write_eof()
        finally:
            os.close(fd)
    return response


@routes.put("/volumecontent/{volume_id}/file")
async def write_file(request: web.Request) -> web.Response:
    store, vol = await _authorized(request)
    path, (uid, gid, mode), force = _path(request), _owner(request.query), schemas.query_bool(request.query, "force")
    length = request.content_length
    try:
        async with store.gate(vol.volume_id).shared():
            upload = await asyncio.to_thread(store.root(vol).begin_upload, path, force, length)
            try:
                async for chunk in request.content.iter_chunked(CHUNK):
                    await asyncio.to_thread(upload.write, chunk)
                entry = await asyncio.to_thread(upload.commit, uid, gid, mode)
            except BaseException:
                await asyncio.to_thread(upload.abort)
                raise
    except KeepStateError:
        if length is None or length <= DRAIN_LIMIT:
            await _drain(request)
        raise
    return web.json_response(entry, status=201)


async def _drain(request: web.Request) -> None:
    """Read what is left of a refused upload (bounded), so the client reads the error instead of a reset."""
    read = 0
    try:
        while read <= DRAIN_LIMIT:
            chunk = await request.content.readany()
            if not chunk:
                return
            read += len(chunk)
    except (TimeoutError, OSError):
        return
