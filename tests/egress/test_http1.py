"""HTTP/1 heads without sockets: requests parsed and framed, headers set, secrets filled; responses framed."""

from __future__ import annotations

import json

import pytest

from keepstate.egress.http1 import (
    CHUNKED,
    TUNNEL,
    UNTIL_CLOSE,
    Answer,
    BadResponse,
    parse_head,
    parse_response_head,
    set_rule_headers,
)
from keepstate.egress.policy import HeaderRule

SECRETS = {"key": "VALUE-1", "nl": "a\r\nb", "wide": "snow\u2603"}


def head(*lines: str) -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_parse_and_encode_round_trip() -> None:
    raw = head("POST /a?b=c HTTP/1.1", "Host: api.test:8443", "X-A:  spaced  ", "content-length: 3")
    req = parse_head(raw)
    assert (req.method, req.target, req.version, req.host) == ("POST", "/a?b=c", "HTTP/1.1", "api.test")
    assert req.get("x-a") == "spaced" and req.framing() == 3
    assert parse_head(req.encode()).headers == req.headers


@pytest.mark.parametrize("raw", [
    head("GET / HTTP/1.1", " folded: no"),
    head("GET / HTTP/1.1", "bad header"),
    head("GET  / HTTP/1.1"),
    head("GET / HTTP/2"),
])
def test_malformed_heads_are_400(raw: bytes) -> None:
    with pytest.raises(Answer) as e:
        parse_head(raw)
    assert e.value.status == 400


@pytest.mark.parametrize("lines,expected", [
    (["Transfer-Encoding: gzip, chunked"], None),
    (["Content-Length: 5", "content-length: 5"], 5),
    ([], 0),
])
def test_framing(lines: list[str], expected: int | None) -> None:
    assert parse_head(head("POST / HTTP/1.1", *lines)).framing() == expected


@pytest.mark.parametrize("lines", [
    ["Transfer-Encoding: chunked", "Content-Length: 5"],  # smuggling
    ["Transfer-Encoding: chunked, gzip"],
    ["Content-Length: 5", "Content-Length: 6"],
    ["Content-Length: -1"],
])
def test_ambiguous_framing_is_refused(lines: list[str]) -> None:
    with pytest.raises(Answer) as e:
        parse_head(head("POST / HTTP/1.1", *lines)).framing()
    assert e.value.status == 400


def test_rules_replace_case_insensitively_and_fill_secrets() -> None:
    req = parse_head(head("GET / HTTP/1.1", "Host: api.test", "AUTHORIZATION: mine", "authorization: again"))
    rules = (HeaderRule((("Authorization", "Bearer ${e2b.secrets.KEY}"), ("Content-Length", "9"))),
             HeaderRule((("X-Two", "${e2b.secrets.key}-${e2b.secrets.key}"),)))
    assert set_rule_headers(req, "api.test", rules, SECRETS.get) == ["Authorization", "X-Two"]
    assert req.values("authorization") == ["Bearer VALUE-1"] and req.get("x-two") == "VALUE-1-VALUE-1"
    assert req.get("content-length") is None  # framing headers are never set by a rule


def test_a_value_beyond_latin1_goes_as_its_utf8_bytes() -> None:
    req = parse_head(head("GET / HTTP/1.1", "Host: api.test"))
    set_rule_headers(req, "api.test", (HeaderRule((("X-W", "${e2b.secrets.wide}"),)),), SECRETS.get)
    assert b"X-W: snow\xe2\x98\x83\r\n" in req.encode()


@pytest.mark.parametrize("template,named", [("${e2b.secrets.gone}", "'gone'"), ("${e2b.secrets.nl}", "'nl'")])
def test_unusable_secrets_are_a_502_naming_them_and_nothing_is_set(template: str, named: str) -> None:
    req = parse_head(head("GET / HTTP/1.1", "Host: api.test"))
    before = list(req.headers)
    rules = (HeaderRule((("X-Ok", "${e2b.secrets.key}"), ("X-Bad", template))),)
    with pytest.raises(Answer) as e:
        set_rule_headers(req, "api.test", rules, SECRETS.get)
    body = e.value.response().split(b"\r\n\r\n", 1)[1]
    message = json.loads(body)["message"]
    assert e.value.status == 502 and named in message and "X-Bad" in message
    assert not any(v in body.decode() for v in SECRETS.values())
    assert req.headers == before


# --- the client's connection, the upstream's ----------------------------------------------------------------------

@pytest.mark.parametrize("lines,closes,sent", [
    (["Connection: close"], True, []),
    (["Connection: Upgrade, close", "Upgrade: x"], True, ["Upgrade"]),
    (["Connection: keep-alive"], False, ["keep-alive"]),
    ([], False, []),
])
def test_a_clients_close_is_kept_from_the_upstream(lines: list[str], closes: bool, sent: list[str]) -> None:
    req = parse_head(head("GET / HTTP/1.1", "Host: a.test", *lines))
    assert req.closes is closes
    req.keep_upstream()
    assert req.values("connection") == sent


def test_an_http10_client_closes_unless_it_says_keep_alive() -> None:
    assert parse_head(head("GET / HTTP/1.0")).closes
    assert not parse_head(head("GET / HTTP/1.0", "Connection: Keep-Alive")).closes


@pytest.mark.parametrize("status,lines,method,expected", [
    ("200 OK", ["Content-Length: 12"], "GET", 12),
    ("200 OK", ["Content-Length: 12, 12"], "GET", 12),
    ("200 OK", ["Content-Length: 12"], "HEAD", 0),
    ("204 No Content", [], "GET", 0),
    ("304 Not Modified", ["Content-Length: 12"], "GET", 0),
    ("100 Continue", [], "POST", 0),
    ("200 OK", ["Transfer-Encoding: gzip, chunked"], "GET", CHUNKED),
    ("200 OK", ["Transfer-Encoding: gzip"], "GET", UNTIL_CLOSE),
    ("200 OK", [], "GET", UNTIL_CLOSE),
    ("101 Switching Protocols", ["Upgrade: websocket"], "GET", TUNNEL),
    ("200 Connection established", [], "CONNECT", TUNNEL),
])
def test_response_framing(status: str, lines: list[str], method: str, expected: int) -> None:
    assert parse_response_head(head(f"HTTP/1.1 {status}", *lines)).framing(method) == expected


@pytest.mark.parametrize("raw", [
    head("HTTP/1.1 200 OK", "Content-Length: 1", "Content-Length: 2"),
    head("HTTP/1.1 200 OK", "Content-Length: x"),
])
def test_a_response_with_a_wrong_length_is_refused(raw: bytes) -> None:
    with pytest.raises(BadResponse):
        parse_response_head(raw).framing("GET")


@pytest.mark.parametrize("raw", [head("HTTP/2 200"), head("HTTP/1.1 20 OK"), head("HTTP/1.1 200 OK", "bad line"),
                                 b"SSH-2.0-OpenSSH_9.6\r\n\r\n"])
def test_malformed_responses(raw: bytes) -> None:
    with pytest.raises(BadResponse):
        parse_response_head(raw)


@pytest.mark.parametrize("version,lines,keeps", [
    ("HTTP/1.1", ["Content-Length: 1"], True),
    ("HTTP/1.1", ["Content-Length: 1", "Connection: close"], False),
    ("HTTP/1.0", ["Content-Length: 1", "Connection: keep-alive"], False),
    ("HTTP/1.1", ["Content-Length: 1", "Transfer-Encoding: chunked"], False),  # both: RFC 9112 6.1 closes
])
def test_whether_a_response_keeps_its_connection(version: str, lines: list[str], keeps: bool) -> None:
    assert parse_response_head(head(f"{version} 200 OK", *lines)).keeps_alive is keeps


def test_the_head_a_closing_client_gets_and_the_announced_idle_timeout() -> None:
    resp = parse_response_head(head("HTTP/1.1 200 OK", "Content-Length: 1", "Connection: keep-alive",
                                    "Keep-Alive: timeout=5, max=100", "X-A: b"))
    assert resp.idle_s == 5.0
    closing = parse_response_head(resp.closing())
    assert closing.headers == [("Content-Length", "1"), ("X-A", "b"), ("Connection", "close")]
    assert closing.status == 200 and closing.raw.startswith(b"HTTP/1.1 200 OK\r\n")
    said = parse_response_head(head("HTTP/1.1 200 OK", "Connection: close"))
    assert said.closing() == said.raw and said.idle_s is None
