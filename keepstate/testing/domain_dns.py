"""A resolver for a server's own domain, for tests of clients that know only `E2B_DOMAIN`.

Such a client (the next major E2B SDK) reaches the control plane at `api.<domain>` and a sandbox's port at
`<port>-<id>.<domain>`: names a real deployment gets from a wildcard DNS record. In a test run they come from this
resolver: `<domain>` and `*.<domain>` answer the server's address (on loopback: the test's own namespace), any
other name NXDOMAIN. The clients use it through a resolv.conf of their own, bind-mounted over /etc/resolv.conf in a
private mount namespace (`run`), so nothing on the host changes and nothing else is resolved.

    python -m keepstate.testing.domain_dns serve --listen 127.0.0.53 --domain ks.test --address 127.0.0.1
    python -m keepstate.testing.domain_dns run --resolver 127.0.0.53 -- CMD [ARG...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from typing import Any

from .internet_dns import serve_dns


def table(domain: str, address: str) -> dict[str, str]:
    domain = domain.lower().rstrip(".").split(":")[0]  # a domain with a port (`ks.test:8443`) names its host
    return {domain: address, f"*.{domain}": address}


async def _serve(listen: str, domain: str, address: str) -> None:
    log: list[dict[str, Any]] = []
    await serve_dns(listen, table(domain, address), log)
    print(f"resolving {domain} and *.{domain} to {address} on {listen}:53", flush=True)
    await asyncio.Event().wait()


RUN = 'mount --make-rprivate / && mount --bind "$0" /etc/resolv.conf && exec "$@"'


def run_argv(resolver: str, argv: list[str]) -> list[str]:
    """`argv` in a mount namespace of its own whose /etc/resolv.conf names only `resolver`."""
    fd, path = tempfile.mkstemp(prefix="ks-resolv-", suffix=".conf")
    with os.fdopen(fd, "w") as f:
        f.write(f"nameserver {resolver}\noptions timeout:1 attempts:3\n")
    os.chmod(path, 0o644)
    return ["unshare", "-m", "--", "sh", "-c", RUN, path, *argv]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m keepstate.testing.domain_dns", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="answer DOMAIN and *.DOMAIN with ADDRESS, on LISTEN:53")
    serve.add_argument("--listen", required=True)
    serve.add_argument("--domain", required=True)
    serve.add_argument("--address", default="127.0.0.1")
    run = sub.add_parser("run", help="run a command whose only resolver is RESOLVER")
    run.add_argument("--resolver", required=True)
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "serve":
        asyncio.run(_serve(args.listen, args.domain, args.address))
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("run needs a command")
    os.execvp("unshare", run_argv(args.resolver, cmd))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
