"""Desktops for computer-use agents through the stock `e2b-desktop` SDK (docs/design/desktop.md): `Sandbox.create()`
picks the `desktop` template and starts X and XFCE in it; screenshots, the mouse, the keyboard and applications work
as the SDK drives them; its stream is noVNC over the 6080 port URL (HTTPS by domain, the WebSocket speaking RFB,
VNC authentication with `require_auth`); and a desktop with Chromium open is paused, resumed and forked with its
windows and pages as they were."""

from __future__ import annotations

import os
import ssl
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("e2b_desktop", reason="e2b-desktop is installed in the main venv only (pyproject's test extra)")

from e2b.sandbox.commands.command_handle import CommandExitException  # noqa: E402
from e2b_desktop import Sandbox  # noqa: E402
from vnc import NONE, VNC_AUTH, handshake  # noqa: E402

from sdkharness import DOMAIN, Server, wait_until  # noqa: E402

# A page served inside the sandbox: what is typed into it becomes the window's title (`KS:<text>`), so a window's
# title says what its page holds.
PAGE = ("<!doctype html><html><head><title>KS:</title></head><body><h1>KeepState desktop</h1>"
        "<input id=q autofocus oninput=\"document.title='KS:'+this.value\"></body></html>")


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:16]
    width, height = struct.unpack(">II", data[16:24])  # IHDR, the first chunk
    return width, height


def windows(desk: Sandbox, cls: str) -> list[str]:
    try:
        return desk.get_application_windows(cls)
    except CommandExitException:  # xdotool search exits 1 when nothing matches
        return []


def titled(desk: Sandbox, cls: str, want: Callable[[str], bool], timeout: float = 90) -> str:
    """The window of class `cls` whose title satisfies `want`, once there is one."""
    seen: dict[str, str] = {}

    def look() -> str | None:
        seen.clear()
        seen.update((w, desk.get_window_title(w)) for w in windows(desk, cls))
        return next((w for w, title in seen.items() if want(title)), None)

    return wait_until(look, timeout, lambda: f"a {cls} window titled as wanted in {desk.sandbox_id} (seen: {seen})",
                      every=0.5)


def serve_page(desk: Sandbox) -> str:
    desk.files.write("/home/user/site/index.html", PAGE)
    desk.commands.run("cd /home/user/site && python3 -m http.server 8000", background=True, timeout=0)
    wait_until(lambda: desk.commands.run("curl -fsS http://localhost:8000/ >/dev/null; echo $?").stdout.strip()
               == "0", 30, "the page's server")
    return "http://localhost:8000/"


def endpoint(desk: Sandbox, server: Server) -> tuple[str, dict[str, str], ssl.SSLContext | None]:
    """Where a viewer reaches the stream: its port URL over HTTPS when the client knows only the domain; else the
    router's plain listener, the sandbox and port named by E2B's routing headers."""
    if DOMAIN:
        return f"https://{desk.get_host(6080)}", {}, ssl.create_default_context(cafile=os.environ.get("SSL_CERT_FILE"))
    return server.url, {"E2b-Sandbox-Id": desk.sandbox_id, "E2b-Sandbox-Port": "6080"}, None


def fetch(base: str, path: str, headers: dict[str, str], context: ssl.SSLContext | None) -> tuple[int, str]:
    with urllib.request.urlopen(urllib.request.Request(base + path, headers=headers), timeout=30,
                                context=context) as r:
        return r.status, r.read().decode(errors="replace")


def rfb(desk: Sandbox, server: Server, password: str | None = None):  # type: ignore[no-untyped-def]
    base, headers, context = endpoint(desk, server)
    return handshake(base.replace("https://", "wss://").replace("http://", "ws://") + "/websockify", headers,
                     context, password)


@pytest.fixture(scope="module")
def desk(e2b_env: None) -> Iterator[Sandbox]:
    d = Sandbox.create(timeout=900)
    try:
        yield d
    finally:
        d.kill()


def test_screen_mouse_keyboard_and_applications(desk: Sandbox) -> None:
    first = desk.screenshot()
    assert png_size(first) == desk.get_screen_size() == (1024, 768)
    desk.move_mouse(321, 234)
    assert desk.get_cursor_position() == (321, 234)
    # Text typed into a terminal runs in its shell.
    desk.launch("xfce4-terminal")
    titled(desk, "xfce4-terminal", lambda title: "user@" in title)  # its shell has started and set the title
    desk.write("echo typed-into-xfce4-terminal > /tmp/typed")
    desk.press("enter")
    wait_until(lambda: desk.commands.run("cat /tmp/typed 2>/dev/null || true").stdout == "typed-into-xfce4-terminal\n",
               30, "the typed command to run")
    # open() of a page: xdg-open hands it to Chromium, whose window shows the page.
    url = serve_page(desk)
    desk.open(url)
    window = titled(desk, "chromium", lambda title: title.startswith("KS:"))
    assert desk.get_current_window_id() == window
    after = desk.screenshot()
    assert png_size(after) == (1024, 768) and after != first


def test_the_stream_over_its_port_url_with_and_without_auth(desk: Sandbox, server: Server) -> None:
    desk.stream.start(require_auth=True)
    key = desk.stream.get_auth_key()
    url = desk.stream.get_url(auth_key=key, view_only=True)
    assert url.startswith(f"https://6080-{desk.sandbox_id}.") and "/vnc.html?autoconnect=true" in url
    assert "view_only=true" in url and f"password={key}" in url
    base, headers, context = endpoint(desk, server)
    assert url.startswith(base + "/vnc.html") or not DOMAIN
    status, page = fetch(base, "/vnc.html", headers, context)
    assert status == 200 and "noVNC" in page
    # The page's script reads the options the SDK puts in the URL.
    _, ui = fetch(base, "/app/ui.js", headers, context)
    assert "view_only" in ui and "autoconnect" in ui and "password" in ui
    refused = rfb(desk, server, password="not-the-key")
    assert refused.greeting.startswith(b"RFB 003.00") and refused.security_types == [VNC_AUTH]
    assert not refused.authenticated
    viewer = rfb(desk, server, password=key)
    assert viewer.authenticated and (viewer.width, viewer.height) == (1024, 768), viewer
    # Stopped: nothing listens on the port any more, and the router says so (E2B's 502 for a closed port).
    desk.stream.stop()
    with pytest.raises(urllib.error.HTTPError) as closed:
        wait_until(lambda: fetch(base, "/vnc.html", headers, context)[0] != 200, 30, "the stream to stop")
    assert closed.value.code == 502


@pytest.mark.skipif(DOMAIN is not None, reason="the main pass runs it; by domain, the stream over HTTPS is the test "
                                               "above, and a pause or a fork does not depend on how a client is told")
def test_a_desktop_with_a_page_open_survives_a_pause_and_its_forks_diverge(e2b_env: None, server: Server) -> None:
    desk = Sandbox.create(timeout=900)
    made = [desk]
    try:
        url = serve_page(desk)
        desk.launch("google-chrome", url)  # E2B's name for the browser: Chromium here, as class Google-chrome
        window = titled(desk, "Google-chrome", lambda title: title.startswith("KS:"))
        desk.write("before")
        titled(desk, "Google-chrome", lambda title: title.startswith("KS:before"))
        desk.stream.start()  # without require_auth: a viewer is asked for no password
        viewer = rfb(desk, server)
        assert viewer.security_types == [NONE] and viewer.authenticated, viewer

        started = time.monotonic()
        desk.pause()
        paused = time.monotonic()
        resumed = Sandbox.connect(desk.sandbox_id, timeout=900)
        print(f"desktop pause {paused - started:.1f} s, resume {time.monotonic() - paused:.1f} s")
        # The same window, its page as it was, the stream listening again.
        assert titled(resumed, "Google-chrome", lambda title: title.startswith("KS:before")) == window
        assert png_size(resumed.screenshot()) == (1024, 768)
        assert rfb(resumed, server).authenticated

        forks = resumed.fork(count=3, timeout=900)
        errors = [f for f in forks if isinstance(f, Exception)]
        assert not errors, errors
        children = [f for f in forks if isinstance(f, Sandbox)]
        made += children
        for i, child in enumerate(children):
            child.write(f"-fork{i}")
        for i, child in enumerate(children):
            assert titled(child, "Google-chrome", lambda title, i=i: title.startswith(f"KS:before-fork{i}")) == window
            assert rfb(child, server).authenticated  # each fork's own stream
        assert resumed.get_window_title(window).startswith("KS:before")
        assert "fork" not in resumed.get_window_title(window)
    finally:
        for sbx in made:
            try:
                sbx.kill()
            except Exception:
                pass
