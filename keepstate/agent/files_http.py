"""`GET /files` (download) and `POST /files` (multipart or octet-stream upload)."""

from __future__ import annotations

import errno
import os
import stat
import time
import zlib
from collections.abc import AsyncIterator
from typing import Any

from keepstate.agent.asgi import (
    HTTPError,
    Receive,
    Scope,
    Send,
    header,
    headers_with_prefix,
    iter_body,
    query,
    send_json,
)
from keepstate.agent.auth import AuthError, check_file_access
from keepstate.agent.entry import MetadataError, replace_metadata, validate_metadata
from keepstate.agent.journal import Journal
from keepstate.agent.permissions import PermissionDenied, check_create, check_read, for_user
from keepstate.agent.settings import SandboxSettings
from keepstate.agent.users import BadPath, UnknownUser, User, lookup_user, make_dirs_for, resolve_path

READ_CHUNK = 1 << 20
WRITE_BUFFER = 1 << 20  # few large writes: fewer WRITE events for watchers, fewer syscalls


def _authorize(scope: Scope, settings: SandboxSettings, operation: str) -> tuple[dict[str, str], User]:
    q = query(scope)
    username = q.get("username") or None
    try:
        check_file_access(
            token=settings.access_token,
            header_token=header(scope, "x-access-token"),
            path=q.get("path", ""),
            operation=operation,
            user=username,
            signature=q.get("signature"),
            expiration=q.get("signature_expiration"),
            now=time.time(),
        )
        return q, lookup_user(username or settings.default_user)
    except (AuthError, UnknownUser) as e:
        raise HTTPError(401, str(e)) from None


def _resolve(path: str, user: User, settings: SandboxSettings) -> str:
    try:
        return resolve_path(path, user, settings.default_workdir)
    except BadPath as e:
        raise HTTPError(400, str(e)) from None


def _accepts_gzip(accept_encoding: str | None) -> bool:
    for item in (accept_encoding or "").split(","):
        name, _, params = item.strip().partition(";")
        if name.strip().lower() in ("gzip", "*"):
            q = params.strip()
            return not (q.startswith("q=") and float(q[2:] or 0) == 0)
    return False


def _content_type(path: str) -> str:
    import mimetypes  # lazily: reading the mime database costs start-up time

    guessed, _ = mimetypes.guess_type(path)
    return guessed or "application/octet-stream"


async def download(scope: Scope, receive: Receive, send: Send, settings: SandboxSettings) -> None:
    q, user = _authorize(scope, settings, "read")
    path = _resolve(q.get("path", ""), user, settings)
    try:
        check_read(path, for_user(user.name, user.uid, user.gid))
    except PermissionDenied as e:
        raise HTTPError(403, str(e)) from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise HTTPError(404, f"path '{path}' does not exist") from None
    except IsADirectoryError:
        raise HTTPError(400, f"path '{path}' is a directory") from None
    except OSError as e:
        raise HTTPError(500, f"error opening '{path}': {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise HTTPError(400, f"path '{path}' is a directory")
        gzip_it = _accepts_gzip(header(scope, "accept-encoding"))
        name = os.path.basename(path).replace('"', "%22")
        headers = [
            (b"content-type", _content_type(path).encode()),
            (b"content-disposition", f'inline; filename="{name}"'.encode()),
            (b"vary", b"Accept-Encoding"),
        ]
        if gzip_it:
            headers.append((b"content-encoding", b"gzip"))
        elif stat.S_ISREG(st.st_mode):
            headers.append((b"content-length", str(st.st_size).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        compressor = zlib.compressobj(5, zlib.DEFLATED, 31) if gzip_it else None
        while True:
            chunk = os.read(fd, READ_CHUNK)
            if not chunk:
                break
            if compressor is not None:
                chunk = compressor.compress(chunk)
                if not chunk:
                    continue
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        tail = compressor.flush() if compressor is not None else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})
    finally:
        os.close(fd)


class FileWriter:
    """Writes one uploaded file: parents created for (and owned by) the user, then create → chown → write, so
    a watcher sees CREATE, CHMOD, WRITE like with envd."""

    def __init__(self, path: str, user: User, metadata: dict[str, str]) -> None:
        self.path = path
        self._metadata = metadata
        self._buffer = bytearray()
        self._size = 0
        try:
            if os.path.isdir(path):
                raise HTTPError(400, f"path '{path}' is a directory")
            check_create(path, for_user(user.name, user.uid, user.gid))
            make_dirs_for(os.path.dirname(path), user)
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        except PermissionDenied as e:
            raise HTTPError(403, str(e)) from None
        except OSError as e:
            raise _write_error(e, path) from None
        try:
            if os.geteuid() == 0:
                os.fchown(self._fd, user.uid, user.gid)
        except OSError as e:
            os.close(self._fd)
            raise _write_error(e, path) from None

    def write(self, data: bytes) -> None:
        self._size += len(data)
        self._buffer += data
        if len(self._buffer) >= WRITE_BUFFER:
            self._flush()

    def _flush(self) -> None:
        view = memoryview(self._buffer)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            raise _write_error(e, self.path) from None
        finally:
            view.release()
        self._buffer.clear()

    def close(self) -> dict[str, Any]:
        try:
            self._flush()
            replace_metadata(self._fd, self._metadata)  # also when empty: a rewrite clears what was there
        except OSError as e:
            raise _write_error(e, self.path) from None
        finally:
            os.close(self._fd)
        # `_size` is for the journal; upload() removes it before answering.
        result: dict[str, Any] = {"path": self.path, "name": os.path.basename(self.path), "type": "file",
                                  "_size": self._size}
        if self._metadata:
            result["metadata"] = dict(self._metadata)
        return result

    def abort(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass


def _write_error(e: OSError, path: str) -> HTTPError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return HTTPError(507, "not enough disk space available")
    if e.errno == errno.EISDIR:
        return HTTPError(400, f"path '{path}' is a directory")
    if e.errno in (errno.ENOTDIR, errno.ENAMETOOLONG, errno.EINVAL):
        return HTTPError(400, f"invalid path '{path}': {e.strerror}")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return HTTPError(403, f"permission denied: '{path}'")
    return HTTPError(500, f"error writing '{path}': {e.strerror}")


async def _decoded_body(scope: Scope, receive: Receive) -> AsyncIterator[bytes]:
    encoding = (header(scope, "content-encoding") or "identity").strip().lower()
    if encoding in ("", "identity"):
        async for chunk in iter_body(receive):
            yield chunk
        return
    if encoding != "gzip":
        raise HTTPError(400, f"unsupported Content-Encoding '{encoding}'")
    inflater = zlib.decompressobj(wbits=31)
    try:
        async for chunk in iter_body(receive):
            out = inflater.decompress(chunk)
            if out:
                yield out
        tail = inflater.flush()
    except zlib.error as e:
        raise HTTPError(400, f"invalid gzip body: {e}") from None
    if not inflater.eof:
        raise HTTPError(400, "invalid gzip body: truncated stream")
    if tail:
        yield tail


def _metadata(scope: Scope) -> dict[str, str]:
    metadata = headers_with_prefix(scope, "x-metadata-")
    try:
        validate_metadata(metadata)
    except MetadataError as e:
        raise HTTPError(400, str(e)) from None
    return metadata


def _form_filename(raw: bytes) -> str:
    """httpx sends UTF-8 filenames and escapes `"`, CR, LF the HTML5 way."""
    name = raw.decode("latin-1").encode("latin-1").decode("utf-8", "replace")
    return name.replace("%22", '"').replace("%0D", "\r").replace("%0A", "\n")


class _MultipartUpload:
    """python-multipart callbacks → one FileWriter per part, in order."""

    def __init__(self, path_override: str | None, user: User, settings: SandboxSettings, metadata: dict[str, str]):
        self._path_override = path_override
        self._user = user
        self._settings = settings
        self._metadata = metadata
        self._field = bytearray()
        self._value = bytearray()
        self._headers: dict[str, bytes] = {}
        self._writer: FileWriter | None = None
        self.results: list[dict[str, Any]] = []

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda d, s, e: self._field.extend(d[s:e]),
            "on_header_value": lambda d, s, e: self._value.extend(d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
        }

    def _part_begin(self) -> None:
        self._headers = {}

    def _header_end(self) -> None:
        self._headers[self._field.decode("latin-1").lower()] = bytes(self._value)
        self._field.clear()
        self._value.clear()

    def _headers_finished(self) -> None:
        from python_multipart.multipart import parse_options_header

        _, options = parse_options_header(self._headers.get("content-disposition", b""))
        filename = options.get(b"filename")
        target = self._path_override or (_form_filename(filename) if filename else "")
        if not target:
            raise HTTPError(400, "each file part needs a filename (the destination path) or the 'path' query parameter")
        self._writer = FileWriter(_resolve(target, self._user, self._settings), self._user, self._metadata)

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._writer is not None:
            self._writer.write(data[start:end])

    def _part_end(self) -> None:
        if self._writer is not None:
            self.results.append(self._writer.close())
            self._writer = None

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()


async def upload(scope: Scope, receive: Receive, send: Send, settings: SandboxSettings,
                 journal: Journal | None = None) -> None:
    q, user = _authorize(scope, settings, "write")
    metadata = _metadata(scope)
    content_type = header(scope, "content-type") or ""
    path_param = q.get("path") or None
    if content_type.lower().startswith("multipart/form-data"):
        results = await _upload_multipart(scope, receive, content_type, path_param, user, settings, metadata)
    elif content_type.lower().startswith("application/octet-stream"):
        if not path_param:
            raise HTTPError(400, "the 'path' query parameter is required for application/octet-stream uploads")
        writer = FileWriter(_resolve(path_param, user, settings), user, metadata)
        try:
            async for chunk in _decoded_body(scope, receive):
                writer.write(chunk)
        except BaseException:
            writer.abort()
            raise
        results = [writer.close()]
    else:
        raise HTTPError(400, f"unsupported Content-Type '{content_type}': use multipart/form-data or "
                             "application/octet-stream")
    if not results:
        raise HTTPError(400, "no file in the request")
    if journal is not None:
        for r in results:
            journal.append("file.write", {"path": r["path"], "size": r.pop("_size"), "user": user.name})
    else:
        for r in results:
            r.pop("_size")
    await send_json(send, 200, results)


async def _upload_multipart(
    scope: Scope, receive: Receive, content_type: str, path_param: str | None, user: User,
    settings: SandboxSettings, metadata: dict[str, str],
) -> list[dict[str, Any]]:
    from python_multipart.exceptions import MultipartParseError
    from python_multipart.multipart import MultipartParser, parse_options_header

    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise HTTPError(400, "multipart/form-data without a boundary")
    state = _MultipartUpload(path_param, user, settings, metadata)
    parser = MultipartParser(boundary, state.callbacks())  # type: ignore[arg-type]
    try:
        async for chunk in _decoded_body(scope, receive):
            parser.write(chunk)
        parser.finalize()
    except MultipartParseError as e:
        state.abort()
        raise HTTPError(400, f"invalid multipart body: {e}") from None
    except BaseException:
        state.abort()
        raise
    return state.results
