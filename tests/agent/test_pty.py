"""PTY through the stock SDK: create, input, resize, kill, connect."""

from __future__ import annotations

import pytest
from e2b import CommandExitException
from e2b.sandbox.commands.command_handle import PtySize


def _collect(handle) -> tuple[bytes, object]:  # type: ignore[no-untyped-def]
    out = bytearray()
    try:
        result = handle.wait(on_pty=lambda data: out.extend(data))
    except CommandExitException as e:
        result = e
    return bytes(out), result


def _read_until(events, out: bytearray, marker: bytes, start: int = 0) -> int:  # type: ignore[no-untyped-def]
    """Consume PTY output until `marker` shows up after `start`, so input is only typed once the shell is ready
    for it. Returns the index just past the marker. Looks at what was already read first: one piece of output
    may hold several markers (the echo, the result and the next prompt often come together)."""
    found = out.find(marker, start)
    while found < 0:
        try:
            _stdout, _stderr, pty = next(events)
        except StopIteration:
            raise AssertionError(f"{marker!r} never appeared in {bytes(out)!r}") from None
        if pty:
            out.extend(pty)
        found = out.find(marker, start)
    return found + len(marker)


def test_pty_input_output_and_exit(sandbox) -> None:
    handle = sandbox.pty.create(PtySize(rows=24, cols=80))
    sandbox.pty.send_stdin(handle.pid, b"tty; echo $TERM; whoami\n")
    sandbox.pty.send_stdin(handle.pid, b"exit 0\n")
    out, result = _collect(handle)
    assert b"/dev/pts/" in out
    assert b"xterm-256color" in out
    assert b"user" in out
    assert result.exit_code == 0


def test_pty_resize(sandbox) -> None:
    handle = sandbox.pty.create(PtySize(rows=24, cols=80))
    events = iter(handle)
    out = bytearray()
    sandbox.pty.send_stdin(handle.pid, b"stty size\n")
    _read_until(events, out, b"24 80")
    sandbox.pty.resize(handle.pid, PtySize(rows=30, cols=100))
    sandbox.pty.send_stdin(handle.pid, b"stty size\n")
    _read_until(events, out, b"30 100")
    sandbox.pty.kill(handle.pid)


def test_pty_kill(sandbox) -> None:
    handle = sandbox.pty.create(PtySize(rows=24, cols=80))
    assert handle.pid in {p.pid for p in sandbox.commands.list()}
    assert sandbox.pty.kill(handle.pid) is True
    with pytest.raises(CommandExitException) as info:
        handle.wait()
    assert "killed" in (info.value.error or "")


def test_pty_stdin_rejects_pipe_input(sandbox) -> None:
    from e2b import SandboxException

    handle = sandbox.pty.create(PtySize(rows=24, cols=80))
    with pytest.raises(SandboxException):
        sandbox.commands.send_stdin(handle.pid, "not a pipe")
    sandbox.pty.kill(handle.pid)


def test_pty_ctrl_d_ends_shell(sandbox) -> None:
    handle = sandbox.pty.create(PtySize(rows=24, cols=80), user="root", cwd="/tmp")
    events = iter(handle)
    out = bytearray()
    sandbox.pty.send_stdin(handle.pid, b"pwd; echo I am $(whoami)\n")
    after = _read_until(events, out, b"I am root")
    # Only once the next prompt is out has readline put the terminal in raw mode; a ^D typed earlier is eaten
    # by the canonical-mode line discipline.
    _read_until(events, out, b"# ", after)
    assert b"/tmp" in out
    sandbox.pty.send_stdin(handle.pid, b"\x04")
    rest, result = _collect(handle)
    assert result.exit_code == 0


async def test_async_pty(async_sandbox) -> None:
    chunks: list[bytes] = []
    handle = await async_sandbox.pty.create(PtySize(rows=24, cols=80), on_data=chunks.append)
    await async_sandbox.pty.send_stdin(handle.pid, b"echo from-async-pty; exit 5\n")
    with pytest.raises(CommandExitException) as info:
        await handle.wait()
    assert info.value.exit_code == 5
    assert b"from-async-pty" in b"".join(chunks)


def test_pty_ctrl_c_interrupts_the_foreground_command(sandbox) -> None:
    """^C typed into a PTY interrupts the foreground command and the shell goes on, as in a terminal (were the
    signal lost, `sleep 20` would run to its end and `$?` be 0). Under gVisor 20240729 /dev/tty and the tty field
    of /proc/PID/stat do not show the controlling terminal (upstream google/gvisor#10925, #13535); the signal
    gets through all the same.

    The marker is printed by the command's own process: by then bash has made its process group the terminal's
    foreground one (a marker printed by the shell before the fork left a window, under load, in which ^C reached
    the shell and not the command)."""
    handle = sandbox.pty.create(PtySize(rows=24, cols=80))
    events = iter(handle)
    out = bytearray()
    sandbox.pty.send_stdin(handle.pid, b"sh -c 'echo started; exec sleep 20'\n")
    after = _read_until(events, out, b"started\r\n")
    sandbox.pty.send_stdin(handle.pid, b"\x03")
    after = _read_until(events, out, b"$ ", after)  # the next prompt
    sandbox.pty.send_stdin(handle.pid, b'echo "[$?]"\n')
    _read_until(events, out, b"]\r\n", after)  # the typed line's echo ends in '"'
    assert b"[130]\r\n" in out[after:], bytes(out[after:])
    sandbox.pty.kill(handle.pid)
