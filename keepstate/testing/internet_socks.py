"""The fake internet's SOCKS5 proxy (RFC 1928 CONNECT; RFC 1929 user/password when configured).

What a policy's `egressProxy` points at in the tests. It records every CONNECT (target, address type, user, client,
result) so a test can prove the traffic went through it. Domain targets are resolved from the fake DNS table only,
never the system resolver: the proxy lives in the fake internet's namespace, which has no route out anyway.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from typing import Any

CONNECT_TIMEOUT = 5.0
# Reply codes (RFC 1928 section 6)
OK, FAILURE, NOT_ALLOWED, HOST_UNREACHABLE, REFUSED, COMMAND, ADDRESS_TYPE = 0, 1, 2, 4, 5, 7, 8


def _reply(code: int, host: str = "0.0.0.0", port: int = 0) -> bytes:
    return bytes([5, code, 0, 1]) + ipaddress.IPv4Address(host).packed + port.to_bytes(2, "big")


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(256 * 1024):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except (ConnectionError, OSError):
        pass


async def handle(listener: int, auth: tuple[str, str] | None, table: dict[str, str], log: list[dict[str, Any]],
                 reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    peer = writer.get_extra_info("peername")
    upstream: asyncio.StreamWriter | None = None
    try:
        version, count = await reader.readexactly(2)
        methods = await reader.readexactly(count)
        if version != 5:
            return
        user: str | None = None
        if auth is not None:
            if 2 not in methods:
                writer.write(b"\x05\xff")
                return
            writer.write(b"\x05\x02")
            _, ulen = await reader.readexactly(2)
            user = (await reader.readexactly(ulen)).decode("utf-8", "replace")
            (plen,) = await reader.readexactly(1)
            password = (await reader.readexactly(plen)).decode("utf-8", "replace")
            if (user, password) != auth:
                log.append({"listener": listener, "peer": f"{peer[0]}:{peer[1]}", "user": user,
                            "result": "bad credentials", "time": time.time()})
                writer.write(b"\x01\x01")
                return
            writer.write(b"\x01\x00")
        else:
            if 0 not in methods:
                writer.write(b"\x05\xff")
                return
            writer.write(b"\x05\x00")
        _, command, _, atyp = await reader.readexactly(4)
        if atyp == 1:
            host = str(ipaddress.IPv4Address(await reader.readexactly(4)))
            kind = "ipv4"
        elif atyp == 3:
            (n,) = await reader.readexactly(1)
            host = (await reader.readexactly(n)).decode("idna").lower()
            kind = "domain"
        elif atyp == 4:
            await reader.readexactly(18)
            writer.write(_reply(ADDRESS_TYPE))
            return
        else:
            writer.write(_reply(ADDRESS_TYPE))
            return
        port = int.from_bytes(await reader.readexactly(2), "big")
        entry: dict[str, Any] = {"listener": listener, "peer": f"{peer[0]}:{peer[1]}", "user": user,
                                 "target": f"{host}:{port}", "host": host, "port": port, "atyp": kind,
                                 "time": time.time()}
        log.append(entry)
        if command != 1:
            entry["result"] = "command not supported"
            writer.write(_reply(COMMAND))
            return
        address = table.get(host) if kind == "domain" else host
        if address is None:
            entry["result"] = "unknown name"
            writer.write(_reply(HOST_UNREACHABLE))
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(address, port), CONNECT_TIMEOUT)
        except ConnectionRefusedError:
            entry["result"] = "refused"
            writer.write(_reply(REFUSED))
            return
        except (OSError, TimeoutError):
            entry["result"] = "unreachable"
            writer.write(_reply(HOST_UNREACHABLE))
            return
        upstream = up_writer
        entry["result"] = "ok"
        bound = up_writer.get_extra_info("sockname")
        writer.write(_reply(OK, bound[0], bound[1]))
        await writer.drain()
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
    except (asyncio.IncompleteReadError, ConnectionError, OSError, UnicodeError):
        return
    finally:
        if upstream is not None:
            upstream.close()
        try:
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        writer.close()


async def serve_socks(address: str, port: int, auth: tuple[str, str] | None, table: dict[str, str],
                      log: list[dict[str, Any]]) -> asyncio.Server:
    async def on_connect(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await handle(port, auth, table, log, r, w)

    return await asyncio.start_server(on_connect, address, port, reuse_address=True, backlog=256)
