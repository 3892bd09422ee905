"""The proxy behind a real dnat: SO_ORIGINAL_DST read from the kernel, not from the test seam.

Runs in a network namespace of its own (`unshare --net`: loopback only, gone when the process exits), where
203.0.113.7 (a documentation address, the "internet" server) and 198.51.100.9 (the "sandbox") are put on `lo`, and
an nftables `nat output` rule sends the sandbox's TCP to 203.0.113.7:80 to the proxy on 127.0.0.1, as the datapath's
prerouting rule does for a real sandbox. Nothing can leave: the namespace has no other interface.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import asyncio, json, logging, socket, ssl, subprocess
logging.basicConfig(level=logging.INFO)
from aiohttp import web
from keepstate.egress.ca import CA
from keepstate.egress.policy import parse
from keepstate.egress.proxy import Proxy

subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
for a in ("203.0.113.7/32", "198.51.100.9/32"):
    subprocess.run(["ip", "addr", "add", a, "dev", "lo"], check=True)

async def main():
    async def echo(request):
        local = request.transport.get_extra_info("sockname")[0]
        return web.json_response({"headers": dict(request.headers), "local": local})
    app = web.Application()
    app.router.add_get("/{tail:.*}", echo)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "203.0.113.7", 80).start()
    policy = parse({"rules": {"api.rule.test": [{"transform": {"headers": {"X-Key": "${e2b.secrets.k}"}}}]}})
    async def secret_value(name):
        return {"k": "value-1"}.get(name)
    proxy = Proxy(lookup={"198.51.100.9": policy}.get, secret_value=secret_value,
                  ca=CA.create("egress"), upstream_trust=ssl.create_default_context(), guard=lambda ip: False)
    await proxy.start("127.0.0.1", 0)
    port = proxy.address[1]
    rules = ("table ip t {\n chain out {\n  type nat hook output priority -100;\n"
             f"  ip saddr 198.51.100.9 ip daddr 203.0.113.7 tcp dport 80 dnat to 127.0.0.1:{port}\n }}\n}}\n")
    subprocess.run(["nft", "-f", "-"], input=rules.encode(), check=True)
    r, w = await asyncio.open_connection("203.0.113.7", 80, local_addr=("198.51.100.9", 0))
    w.write(b"GET / HTTP/1.1\r\nHost: api.rule.test\r\nConnection: close\r\n\r\n")
    body = (await r.read()).split(b"\r\n\r\n", 1)[1]
    w.close()
    # a connection made to the proxy directly (no dnat) has no original destination: reset
    r2, w2 = await asyncio.open_connection("127.0.0.1", port, local_addr=("198.51.100.9", 0))
    w2.write(b"GET / HTTP/1.1\r\nHost: api.rule.test\r\n\r\n")
    try:
        direct = (await r2.read()).decode()
    except ConnectionResetError:
        direct = "reset"
    w2.close()
    await proxy.stop()
    await runner.cleanup()
    print(json.dumps({"echo": json.loads(body), "direct": direct}))

asyncio.run(main())
'''


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nft") or not shutil.which("unshare"),
                    reason="needs root, nft and unshare (a network namespace of the test's own)")
def test_original_destination_through_a_real_dnat() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(["unshare", "--net", sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["echo"]["headers"]["X-Key"] == "value-1"
    assert result["echo"]["local"] == "203.0.113.7"
    assert result["direct"] == "reset" and "not redirected" in out.stderr
