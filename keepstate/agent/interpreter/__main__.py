"""`python3 -m keepstate.agent.interpreter --port 49999`: run the code-interpreter bridge."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pwd
import signal
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from aiohttp import web

from keepstate.agent.interpreter import DEFAULT_PORT
from keepstate.agent.interpreter.contexts import Contexts
from keepstate.agent.interpreter.envd import Envd
from keepstate.agent.interpreter.kernel import LaunchSpec
from keepstate.agent.interpreter.languages import KERNEL_NAMES
from keepstate.agent.interpreter.server import make_app
from keepstate.ports import AGENT_PORT

log = logging.getLogger("keepstate.agent.interpreter")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m keepstate.agent.interpreter", description=__doc__)
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--workdir", default="/home/user", help="cwd of default contexts")
    p.add_argument("--kernel-user", default="user",
                   help="user kernels run as; '' keeps the bridge's own user (default: user)")
    p.add_argument("--envd-url", default=f"http://127.0.0.1:{AGENT_PORT}", help="the sandbox's envd agent")
    p.add_argument("--runtime-dir", default=None,
                   help="directory for kernel connection files and IPC sockets (default: a new one in /tmp)")
    # Python only: a tslab kernel costs ~235 MB and seconds of CPU at every sandbox start, for a
    # language few sessions use; its default context starts on first use instead.
    p.add_argument("--default-languages", default="python",
                   help="comma-separated languages whose default contexts start with the bridge (default: python)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


# Set by the template for the bridge itself (it imports keepstate from the bind mount); user code
# must not see the bridge's package on its path.
BRIDGE_ONLY_ENV = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")


def kernel_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k not in BRIDGE_ONLY_ENV}


def installed_kernels() -> dict[str, str]:
    """language → kernel name, for the kernel specs installed here."""
    from jupyter_client.kernelspec import KernelSpecManager

    found = set(KernelSpecManager().find_kernel_specs())
    return {lang: name for lang, name in KERNEL_NAMES.items() if name in found}


def runtime_dir(path: str | None, user: str | None) -> Path:
    if path:
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
    else:
        d = Path(tempfile.mkdtemp(prefix="keepstate-interpreter-"))
    os.chmod(d, 0o700)
    if user:
        entry = pwd.getpwnam(user)
        os.chown(d, entry.pw_uid, entry.pw_gid)  # kernels create their IPC sockets here
    return d


async def announce_ready(contexts: Contexts) -> None:
    # benchmarks/interpreter.py reads this line to know when a pooled sandbox is warm.
    log.info("default contexts ready: %s", ", ".join(await contexts.wait_defaults()) or "none")


async def serve(args: argparse.Namespace) -> None:
    user = args.kernel_user or None
    if user is not None and user == pwd.getpwuid(os.getuid()).pw_name:
        user = None
    spec = LaunchSpec(runtime_dir=runtime_dir(args.runtime_dir, user), cwd=args.workdir, user=user,
                      env=kernel_env(os.environ))
    available = installed_kernels()
    log.info("kernels: %s", ", ".join(f"{k}={v}" for k, v in sorted(available.items())) or "none")
    defaults = [lang.strip() for lang in args.default_languages.split(",") if lang.strip()]
    contexts = Contexts(spec, available)
    app = make_app(contexts, Envd(args.envd_url), defaults)
    # handler_cancellation: a client that disconnects cancels its /execute handler, which interrupts the kernel.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    log.info("code interpreter listening on %s:%d", host, port)
    announce = asyncio.create_task(announce_ready(contexts))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    announce.cancel()
    # Kernels first: their executions end, so the streaming handlers finish before aiohttp waits on them.
    await contexts.close()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
