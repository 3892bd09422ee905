"""A minimal computer-use agent on a KeepState desktop: screenshot -> model -> one action, until the model is done.

Self-contained: it starts its own `keepstate serve` (on free ports, in a temporary data directory; the templates
built by `make up` or `make test`), whose metering gateway stands in front of the model provider, and drives a
`desktop` sandbox with the stock `e2b-desktop` SDK. The provider is `keepstate.testing.FakeProvider`, scripted with
computer-use tool calls (open a terminal, type a command, press Enter, done), unless these are set:

    COMPUTER_USE_BASE_URL   an OpenAI-compatible API, e.g. https://api.openai.com/v1
    COMPUTER_USE_API_KEY    its key (it stays with the gateway, on the host; the agent never sees it)
    COMPUTER_USE_MODEL      a model that takes images and tools, e.g. gpt-4.1

The agent calls the model through the gateway with the sandbox's own run token (its OPENAI_BASE_URL and
OPENAI_API_KEY), so each call is in the ledger and billed at most once, whatever retries or resumes happen.

    sudo .venv/bin/python examples/computer_use.py [--task TEXT] [--steps N] [--json]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
KEEPSTATE = Path(sys.executable).parent / "keepstate"
TASK = "Open a terminal and write 'hello from a computer-use agent' into /tmp/agent.txt."
# What the fake model answers, turn by turn (keepstate.testing.FakeProvider's tool_script).
SCRIPT = [
    {"name": "computer", "arguments": {"action": "launch", "app": "xfce4-terminal"}},
    {"name": "computer", "arguments": {"action": "type",
                                       "text": "echo 'hello from a computer-use agent' > /tmp/agent.txt"}},
    {"name": "computer", "arguments": {"action": "key", "keys": "enter"}},
    {"name": "computer", "arguments": {"action": "done", "summary": "wrote /tmp/agent.txt from a terminal"}},
]
TOOL = {"type": "function", "function": {
    "name": "computer",
    "description": "Act on the 1024x768 desktop you see in the last screenshot.",
    "parameters": {"type": "object", "required": ["action"], "properties": {
        "action": {"type": "string", "enum": ["left_click", "double_click", "move_mouse", "type", "key", "launch",
                                              "wait", "done"]},
        "x": {"type": "integer"}, "y": {"type": "integer"},
        "text": {"type": "string", "description": "for type"},
        "keys": {"type": "string", "description": "for key: enter, ctrl+c, alt+tab, ..."},
        "app": {"type": "string", "description": "for launch: xfce4-terminal, google-chrome, mousepad"},
        "uri": {"type": "string"}, "ms": {"type": "integer"},
        "summary": {"type": "string", "description": "for done: what was achieved"},
    }},
}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def provider() -> Iterator[tuple[str, str, str, Any]]:
    """(base URL, key, model, the fake or None): a real provider from the environment, else the scripted fake."""
    if os.environ.get("COMPUTER_USE_BASE_URL"):
        yield (os.environ["COMPUTER_USE_BASE_URL"], os.environ.get("COMPUTER_USE_API_KEY", ""),
               os.environ.get("COMPUTER_USE_MODEL", "gpt-4.1"), None)
        return
    from keepstate.testing import FakeProvider, fake_provider_in_thread

    with fake_provider_in_thread(FakeProvider(api_key="sk-fake-upstream", tool_script=SCRIPT)) as fake:
        yield fake.openai_base_url, "sk-fake-upstream", "fake-computer-use", fake


@contextlib.contextmanager
def server(base_url: str, key: str, model: str) -> Iterator[tuple[str, str, str]]:
    """A KeepState server with the gateway in front of the provider: (API URL, API key, data directory)."""
    home = tempfile.mkdtemp(prefix="keepstate-computer-use-")
    config = Path(home) / "gateway.json"
    config.write_text(json.dumps({"providers": [{"name": "upstream", "kind": "openai", "base_url": base_url,
                                                 "api_key": key, "models": [model]}]}))
    port = free_port()
    env = {**os.environ, "KEEPSTATE_HOME": home}
    log = open(Path(home) / "server.log", "ab")
    proc = subprocess.Popen([str(KEEPSTATE), "serve", "--listen", f"127.0.0.1:{port}", "--pool-size", "0",
                             "--reap-on-exit", "--gateway-config", str(config), "--gateway-port", str(free_port())],
                            env=env, stdout=log, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            if proc.poll() is not None:
                raise SystemExit(f"keepstate serve exited ({proc.returncode}); see {home}/server.log")
            time.sleep(0.2)
        api_key = subprocess.check_output([str(KEEPSTATE), "keys", "create", "computer-use"], env=env,
                                          stderr=subprocess.DEVNULL).decode().strip()
        yield url, api_key, home
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def act(desk: Any, args: dict[str, Any]) -> str:
    """Do one action on the desktop; what happened, for the model."""
    action = args.get("action")
    if action in ("left_click", "double_click", "move_mouse"):
        x, y = int(args["x"]), int(args["y"])
        {"left_click": desk.left_click, "double_click": desk.double_click, "move_mouse": desk.move_mouse}[action](x, y)
        return f"{action} at ({x}, {y})"
    if action == "type":
        desk.write(str(args["text"]))
        return "typed"
    if action == "key":
        desk.press(str(args["keys"]).split("+") if "+" in str(args["keys"]) else str(args["keys"]))
        return f"pressed {args['keys']}"
    if action == "launch":
        app = str(args["app"])
        desk.launch(app, args.get("uri"))
        for _ in range(120):  # until its window shows (and, for a terminal, its shell has named it)
            with contextlib.suppress(Exception):
                if any(app != "xfce4-terminal" or "@" in desk.get_window_title(w)
                       for w in desk.get_application_windows(app)):
                    return f"{app} is open"
            time.sleep(0.5)
        return f"{app} did not open a window in 60 s"
    if action == "wait":
        desk.wait(int(args.get("ms", 1000)))
        return "waited"
    return f"unknown action {action!r}"


def run(task: str, steps: int) -> dict[str, Any]:
    from e2b_desktop import Sandbox
    from openai import OpenAI

    with provider() as (base_url, key, model, fake), server(base_url, key, model) as (url, api_key, home):
        desk = Sandbox.create(api_key=api_key, api_url=url, sandbox_url=url, timeout=600)
        try:
            # The sandbox's own way to the model: the gateway's address and this run's token (no provider key).
            env = desk.commands.run("printenv OPENAI_BASE_URL OPENAI_API_KEY").stdout.split()
            model_client = OpenAI(base_url=env[0], api_key=env[1], max_retries=2)
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": "You operate a Linux desktop with the `computer` tool, one action "
                                              "per turn. Call it with action `done` when the task is complete."},
                {"role": "user", "content": task}]
            actions, summary, calls = [], "", 0
            for _ in range(steps):
                png = base64.b64encode(desk.screenshot()).decode()
                messages.append({"role": "user", "content": [
                    {"type": "text", "text": "The screen now:"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}]})
                reply = model_client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                                              tools=[TOOL])  # type: ignore[list-item]
                calls += 1
                message = reply.choices[0].message
                if not message.tool_calls:
                    summary = message.content or ""
                    break
                call = message.tool_calls[0]
                args = json.loads(call.function.arguments)  # type: ignore[union-attr]
                messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
                if args.get("action") == "done":
                    summary = str(args.get("summary", ""))
                    break
                outcome = act(desk, args)
                actions.append({**args, "outcome": outcome})
                print(f"  {args} -> {outcome}", file=sys.stderr)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": outcome})
            written = desk.commands.run("cat /tmp/agent.txt 2>/dev/null || true").stdout
            ledger = json.loads(subprocess.check_output(
                [str(KEEPSTATE), "ledger", "--json"], env={**os.environ, "KEEPSTATE_HOME": home}))
        finally:
            desk.kill()
        return {"sandbox": desk.sandbox_id, "actions": actions, "summary": summary, "file": written,
                "model_calls": calls,
                "ledger": ledger["totals"], "provider_calls": fake.stats().calls if fake else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default=TASK)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="print the outcome as JSON")
    opts = parser.parse_args()
    out = run(opts.task, opts.steps)
    if opts.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"done in {len(out['actions'])} actions: {out['summary']}\n/tmp/agent.txt: {out['file'].strip()!r}\n"
              f"ledger: {out['ledger']}")


if __name__ == "__main__":
    main()
